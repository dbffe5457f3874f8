"""What a run is built from, before its first step: the model sized to the tokenizer, the
Engine's settings for the layout, and the line that describes the run."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from hybrid.distributed.env import DistributedEnv
from hybrid.distributed.topology import Topology
from hybrid.engine import EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from launch.config import Config, ConfigError
from launch.observe.mfu import Utilization, peak_flops
from models.gpt import GPT, GPTConfig, count_parameters, pad_vocab_size
from models.gpt.hf.lazy import open_hf_weights
from models.hf_native.accounting import native_flops_per_token

if TYPE_CHECKING:
    from models.hf_native.causal_lm import HFCausalLM


def build_model(
    config: Config,
    n_tokens: int,
    tp: TensorParallel,
    device: torch.device | str,
    resume: bool = False,
    buffers_on: torch.device | None = None,
) -> GPT | HFCausalLM:
    """The GPT with the vocabulary sized from the tokenizer (padded to a multiple of 128,
    Megatron's rule; the loss masks the padding), sliced for this TP rank. It is built on
    the meta device; the Engine materialises only what this rank keeps.

    Fine-tuning (`init_from`) keeps the checkpoint's exact vocabulary, every entry a real
    token, and its weights (unless a checkpoint of this run will replace them: `resume`).
    With `model_source=hf` that is the transformers model itself (models.hf_native), its
    buffers made on `buffers_on`.
    """
    model_config = config.model
    p = config.parallel
    recompute = RecomputePolicy(Recompute(p.recompute), p.recompute_every)
    if config.init_from is not None:
        if n_tokens > model_config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {n_tokens} tokens but {config.init_from} has "
                f"{model_config.vocab_size} embeddings; use the tokenizer that came with it "
                "(remove data.tokenizer)"
            )
        if config.model_source == "hf":
            from models.hf_native.causal_lm import HFCausalLM

            full = Recompute(p.recompute) is Recompute.FULL
            return HFCausalLM(config.init_from, not resume, full, buffers_on)
        weights = None
        if not resume:
            weights = open_hf_weights(config.init_from, model_config)  # reads on demand
        return GPT(
            model_config, tp, recompute, config.train.seed, device=device, init_weights=weights
        )
    if model_config.vocab_size is None:
        model_config = dataclasses.replace(model_config, vocab_size=pad_vocab_size(n_tokens))
    elif model_config.vocab_size < n_tokens:
        raise ConfigError(
            f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"{n_tokens} tokens; remove model.vocab_size to size it from the tokenizer"
        )
    return GPT(
        model_config, tp, recompute, config.train.seed, n_real_tokens=n_tokens, device=device
    )


def engine_config(config: Config, dp: int) -> EngineConfig:
    """The Engine's settings for a run of this config at data-parallel degree `dp`."""
    t = config.train
    return EngineConfig(
        zero_stage=config.parallel.zero_stage,
        precision=t.precision,
        micro_batches=t.global_batch_size // (t.micro_batch_size * dp),
        grad_clip=t.grad_clip,
        weight_decay=t.weight_decay,
        grad_reduce_dtype=t.grad_reduce_dtype,
        overlap_param_gather=config.parallel.overlap_param_gather,
        bucket_mb=config.parallel.bucket_mb,
    )


def run_utilization(
    config: Config, model: GPT | HFCausalLM, window: int, env: DistributedEnv
) -> Utilization:
    """The planner's model FLOPs per token (for each step's MFU) and the device's peak."""
    peak = config.train.peak_tflops
    if isinstance(model, GPT):
        return Utilization.for_run(model.config, window, env.world_size, peak, env.device)
    per_token = native_flops_per_token(model, window)
    return Utilization(per_token, env.world_size, peak_flops(peak, env.device))


def run_banner(
    config: Config, model: GPT | HFCausalLM, topology: Topology, data: str, env: DistributedEnv
) -> str:
    """The line a run prints before its first step: model, layout, batch, data, device."""
    t, p = config.train, config.parallel
    window = t.seq_len or config.model.seq_len
    info = model.config
    count = count_parameters(info) if isinstance(info, GPTConfig) else sum(
        q.numel() for q in model.parameters()
    )  # fmt: skip
    kind = f"{info.model_type} as it is, " if config.model_source == "hf" else ""
    return (
        f"model: {kind}{count:,} parameters "
        f"({info.n_layer} layers, d_model {info.d_model}, "
        f"vocab {info.vocab_size}) | {topology.describe()}"
        f"{' + sequence parallel' if p.sequence_parallel else ''} | "
        f"recompute {p.recompute} | "
        f"{t.global_batch_size // (t.micro_batch_size * topology.dp)} micro-batches per step | "
        f"{data} | sequences of {window} tokens | device {env.device}"
    )
