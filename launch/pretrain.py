"""Pretrain a GPT:

    torchrun --standalone --nproc_per_node N -m launch.pretrain \
        --config configs/tiny.yaml [key=value ...]

A plain `python -m launch.pretrain ...` runs the same job in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from hybrid.distributed import (
    DistributedEnv,
    barrier,
    init_distributed,
    shutdown,
    world_size_from_env,
)
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from hybrid.topology import Topology
from models.gpt import GPT, count_parameters, pad_vocab_size

from .checkpointing import restore, resume_from
from .checkpointing import save as save_checkpoint
from .config import Config, ConfigError, load_config, to_dict, validate_layout
from .data import DistributedBatches, PreparedData, TokenWindows, eval_batches, prepare_data
from .data.token_file import resolve_files
from .data.tokenizers import load_tokenizer_folder
from .optim import lr_at
from .tracking import Tracker, format_count, rotate_old_metrics, truncate_metrics
from .trainer import eval_steps, evaluate, train_step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.pretrain", description="Pretrain a GPT (run it under torchrun)."
    )
    parser.add_argument("--config", help="YAML file, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. train.lr=3e-4 parallel.tp=2")
    return parser.parse_args(argv)


def check_before_start(config: Config, world_size: int) -> int:
    """Everything that can be checked without a process group; returns dp."""
    dp = validate_layout(config, world_size)
    try:
        resolve_files(config.data.files)
        if config.data.tokenizer not in ("gpt2", "bpe"):
            load_tokenizer_folder(config.data.tokenizer)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    if config.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision=fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    return dp


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        dp = check_before_start(config, world_size_from_env())
        resume = resume_from(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    env = init_distributed(config.dist_timeout_s)
    try:
        train(config, env, dp, resume)
    except (
        ConfigError
    ) as error:  # found after start-up (e.g. the tokenizer's size): all ranks alike
        if env.is_main:
            print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        shutdown(env)
    return 0


def load_data(config: Config, env: DistributedEnv) -> PreparedData:
    """One rank per node tokenizes into the cache; the others wait, then read it."""
    if env.local_rank != 0:
        barrier(env)
    data = prepare_data(config.data)
    if env.local_rank == 0:
        barrier(env)
    return data


def build_model(
    config: Config, n_tokens: int, tp: TensorParallel, device: torch.device | str
) -> GPT:
    """The GPT with the vocabulary sized from the tokenizer (padded to a multiple of 128,
    Megatron's rule; the loss masks the padding), sliced for this TP rank. Under ZeRO-3 it
    is built on the meta device and the Engine materialises only this rank's shard."""
    model_config = config.model
    if model_config.vocab_size is None:
        model_config = dataclasses.replace(model_config, vocab_size=pad_vocab_size(n_tokens))
    elif model_config.vocab_size < n_tokens:
        raise ConfigError(
            f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"{n_tokens} tokens; remove model.vocab_size to size it from the tokenizer"
        )
    p = config.parallel
    recompute = RecomputePolicy(Recompute(p.recompute), p.recompute_every)
    return GPT(
        model_config, tp, recompute, config.train.seed, n_real_tokens=n_tokens, device=device
    )


def train(
    config: Config, env: DistributedEnv, dp: int, resume: Path | None = None
) -> list[dict[str, Any]]:
    """Run the job from the start or from checkpoint `resume`, to `train.steps` (or
    `train.stop_at`); returns the per-step metrics of this run (the same on every rank)."""
    t, p = config.train, config.parallel
    run_dir = Path(config.run_dir)
    topology = Topology.build(p.tp, env.device.type)
    assert topology.dp == dp
    data = load_data(config, env)
    # Replicated-region dropout draws from the default generator, seeded alike everywhere;
    # TP regions from the TP stream (hybrid.tensor_parallel.random).
    torch.manual_seed(t.seed + 1)
    tp = TensorParallel.from_topology(topology, t.seed, p.sequence_parallel, env.device)
    device = "meta" if p.zero_stage == 3 else env.device
    model = build_model(config, len(data.tokenizer), tp, device)
    engine = Engine(
        model,
        topology,
        tp,
        EngineConfig(
            zero_stage=p.zero_stage,
            precision=t.precision,
            micro_batches=t.global_batch_size // (t.micro_batch_size * dp),
            grad_clip=t.grad_clip,
            weight_decay=t.weight_decay,
        ),
        units=list(model.blocks),
        device=env.device,
    )
    start_step, consumed_samples = 0, 0
    if resume is not None:
        state = restore(resume, engine, config, topology, tp)
        start_step, consumed_samples = state["step"], state["consumed_samples"]
    batches = DistributedBatches(
        TokenWindows(data.train_tokens, model.config.seq_len),
        t.seed,
        t.global_batch_size,
        t.micro_batch_size,
        topology.dp_rank,
        topology.dp,
        start_sample=consumed_samples,
    )
    val_set = eval_batches(
        TokenWindows(data.val_tokens, model.config.seq_len),
        t.eval_batches * t.global_batch_size,
        t.micro_batch_size,
        topology.dp_rank,
        topology.dp,
    )
    tracker = None
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step:
            truncate_metrics(run_dir, start_step)
            print(f"resuming from {resume} at step {start_step}", flush=True)
        else:
            rotate_old_metrics(run_dir)
        resolved = to_dict(config) | {"model": dataclasses.asdict(model.config)}
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        print(
            f"model: {count_parameters(model.config):,} parameters "
            f"({model.config.n_layer} layers, d_model {model.config.d_model}, "
            f"vocab {model.config.vocab_size}) | {topology.describe()}"
            f"{' + sequence parallel' if p.sequence_parallel else ''} | "
            f"recompute {p.recompute} | "
            f"{t.global_batch_size // (t.micro_batch_size * dp)} micro-batches per step | "
            f"{len(data.train_tokens):,} train tokens | device {env.device}",
            flush=True,
        )
        tracker = Tracker(run_dir, config.tracking.wandb, resolved, t.steps, start_step)

    history: list[dict[str, Any]] = []
    evaluate_after = set(eval_steps(t.steps, t.eval_every))
    tokens_per_step = t.global_batch_size * model.config.seq_len
    started = time.perf_counter()
    stop = t.stop_at or t.steps
    if start_step >= stop:
        raise ConfigError(
            f"the checkpoint {resume} is at step {start_step}, which already reaches "
            f"train.steps (or stop_at) = {stop}; raise train.steps or set checkpoint.resume=none"
        )
    for step in range(start_step, stop):
        tick = time.perf_counter()
        lr = lr_at(step, t)
        loss, grad_norm, skipped = train_step(engine, batches.next_step(), lr, env.device)
        elapsed = time.perf_counter() - tick
        metrics = {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / elapsed,
            "step_time_s": elapsed,
        }
        if skipped:
            metrics["skipped"] = True  # fp16 overflow: no update, lower loss scale
        if step + 1 in evaluate_after:
            metrics["val_loss"] = evaluate(engine, val_set, topology.dp_group, env.device)
        history.append(metrics)
        if tracker is not None:
            tracker.log(metrics)
        every = config.checkpoint.every
        if (every and (step + 1) % every == 0) or step + 1 == stop:
            save_checkpoint(engine, config, step + 1, batches.consumed_samples, topology, tp)
    total_time = time.perf_counter() - started
    if stop < t.steps:
        if tracker is not None:
            tracker.finish()
            print(f"stopped after step {stop} (train.stop_at); run again to resume", flush=True)
        return history

    sample = generate_sample(model, data, config, env)  # every rank: TP layers talk
    weights = engine.full_state_dict()  # every rank: gathers across TP and DP
    if tracker is not None:
        tracker.finish()
        save_file(weights, str(run_dir / "model.safetensors"))
        data.tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        if sample is not None:
            print(
                f"--- sample ({config.sample.tokens} tokens) ---\n{sample}\n--- end of sample ---"
            )
        print(summary_line(history, total_time, run_dir), flush=True)
    return history


def generate_sample(
    model: GPT, data: PreparedData, config: Config, env: DistributedEnv
) -> str | None:
    s = config.sample
    if s.tokens == 0:
        return None
    prompt = data.tokenizer.encode(s.prompt, add_special_tokens=False) or [
        data.tokenizer.eos_token_id or 0
    ]
    generator = torch.Generator(env.device).manual_seed(config.train.seed)
    model.eval()
    out = model.generate(
        torch.tensor([prompt], device=env.device),
        s.tokens,
        s.temperature,
        s.top_k,
        generator=generator,
    )
    return data.tokenizer.decode(out[0].tolist())


def summary_line(history: list[dict[str, Any]], total_time: float, run_dir: Path) -> str:
    vals = [m["val_loss"] for m in history if "val_loss" in m]
    speed = statistics.median(m["tokens_per_s"] for m in history)
    parts = [f"done: {len(history)} steps in {total_time:.0f}s", f"loss {history[-1]['loss']:.4f}"]
    if vals:
        parts.append(f"val_loss {vals[0]:.4f} -> {vals[-1]:.4f} ({vals[-1] / vals[0] - 1:+.0%})")
    parts += [f"{format_count(speed)} tokens/s (median)", f"run_dir {run_dir}"]
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
