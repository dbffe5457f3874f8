"""The library half of `launch.plan`: the model a plan is for (a preset's shape or a bare
parameter count), the layout a config asks for, and the search over layouts. The memory
check every run makes (memory_check.py) and the rehearsal use it without loading the
command line."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path
from typing import Any

from hybrid.memory import (
    RECOMPUTE_MODES,
    Hardware,
    Layout,
    Plan,
    RankParameters,
    format_count,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    plan,
)
from launch.config import Config, ConfigError, load_config, preset_names, preset_path
from models.gpt import GPTConfig, count_parameters, flops_per_token, pad_vocab_size
from models.gpt.accounting import (
    rank_parameters,
    recompute_flops_per_token,
    transformer_shape,
    with_seq_len,
)
from models.gpt.model import check_tp_shapes
from models.hf_native.accounting import (
    native_flops_per_token,
    native_rank_parameters,
    native_shape,
)
from models.hf_native.causal_lm import HFCausalLM

GPT2_TOKENS = 50257  # the gpt2 tokenizer; Megatron pads it to 50304 (pad_vocab_size)


class PlanError(ValueError):
    """Bad input; the message names the option and the fix."""


def device_type(args: argparse.Namespace) -> str:
    """The device the planned run computes on: `args.device_type` when the caller knows
    it (the rehearsal runs NCCL's layout on this machine's device), else the backend's
    (NCCL on CUDA, gloo on CPU)."""
    given = getattr(args, "device_type", None)
    if given is not None:
        return given
    return "cuda" if getattr(args, "backend", "nccl") == "nccl" else "cpu"


@dataclasses.dataclass(frozen=True)
class Model:
    """A preset's model (shape and parameters per tp), a Hugging Face model trained as it
    is (`native`: built on meta, counted from its modules, tp=1), or a bare parameter
    count."""

    name: str
    config: GPTConfig | None
    seq_len: int | None  # the training window
    count: int | None = None
    native: HFCausalLM | None = None

    def parameters(self, tp: int) -> RankParameters:
        if self.native is not None:
            return native_rank_parameters(self.native)
        if self.config is None:
            return RankParameters.bare(self.count or 0, tp)
        return rank_parameters(self.config, tp)

    def check(self, layout: Layout) -> None:
        if self.native is not None and (layout.tp != 1 or layout.sequence_parallel):
            raise PlanError(
                f"{self.name} is trained as it is (model_source=hf): tp=1 only (--tp {layout.tp})"
            )
        if self.config is not None:
            try:
                check_tp_shapes(
                    with_seq_len(self.config, self.seq_len), layout.tp, layout.sequence_parallel
                )
            except ValueError as error:
                raise PlanError(f"{error} (--tp {layout.tp})") from None

    def plan(self, layout: Layout, args: argparse.Namespace) -> Plan:
        self.check(layout)
        shape = flops = model_flops = None
        if self.native is not None:
            seq = self.seq_len or 1024
            shape = native_shape(self.native, seq, device_type(args))
            model_flops = native_flops_per_token(self.native, seq)
            flops = native_flops_per_token(self.native, seq, layout.recompute == "full")
        elif self.config is not None:
            shape = transformer_shape(self.config, self.seq_len, device_type(args))
            window = with_seq_len(self.config, self.seq_len)
            model_flops = flops_per_token(window)
            extra = recompute_flops_per_token(window, layout.recompute, layout.recompute_every)
            flops = model_flops + extra
        return plan(
            layout,
            self.parameters(layout.tp),
            shape,
            gpu_memory=args.gpu_memory,
            reserve=args.reserve,
            hardware=args.hardware,
            flops_per_token=flops,
            model_flops_per_token=model_flops,
            backend=getattr(args, "backend", "nccl"),
        )

    def describe(self) -> str:
        if self.native is not None:
            c, total = self.native.config, native_rank_parameters(self.native).total
            return (
                f"{self.name} ({c.model_type}, as it is): {format_count(total)} parameters, "
                f"{c.n_layer} layers, d_model {c.d_model}, sequence {self.seq_len}"
            )
        if self.config is None:
            return f"{format_count(self.count or 0)} parameters (a bare count: model states only)"
        c = self.config
        return (
            f"{self.name}: {format_count(count_parameters(c))} parameters, "
            f"{c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"sequence {self.seq_len or c.seq_len}, vocabulary {c.vocab_size}"
        )


def resolve(args: argparse.Namespace) -> tuple[Model, dict[str, Any]]:
    """The model and the layout's defaults (from the config, or plain ones for --params)."""
    if args.gpus < 1:
        raise PlanError(f"--gpus {args.gpus} must be positive")
    args.gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
    args.reserve = parse_bytes(args.reserve, "--reserve")
    args.hardware = Hardware(
        peak_flops=args.peak_tflops * 1e12,
        efficiency=args.efficiency,
        intra_node_bandwidth=parse_bandwidth(args.intra_node_bandwidth, "--intra-node-bandwidth"),
        inter_node_bandwidth=parse_bandwidth(args.inter_node_bandwidth, "--inter-node-bandwidth"),
        gpus_per_node=args.gpus_per_node,
    )
    if args.params is not None or getattr(args, "hf", None) is not None:
        if args.params is not None:
            model = Model("bare count", None, None, parse_count(args.params, "--params"))
        else:
            model = hf_model(args.hf, args.seq_len)
        defaults = {"tp": 1, "zero_stage": 0, "sequence_parallel": False, "recompute": "none"}
        defaults |= {"recompute_every": 1, "micro_batch": 1, "global_batch": None}
        defaults |= {"precision": "bf16", "grad_reduce_dtype": "fp32", "overlap_param_gather": True}
        if args.bucket_mb is None:
            args.bucket_mb = Layout.bucket_mb  # the engine's default
        return model, defaults
    config = read_config(args.config, args.overrides)
    if args.bucket_mb is None:  # the config's, as the run's engine takes it
        args.bucket_mb = config.parallel.bucket_mb
    m, t = config.model, config.train
    if args.vocab is not None:
        m = dataclasses.replace(m, vocab_size=args.vocab)
    elif m.vocab_size is None:
        if config.data.tokenizer != "gpt2":
            raise PlanError(
                f"the vocabulary of tokenizer {config.data.tokenizer!r} is not known here; "
                "give --vocab N or model.vocab_size=N"
            )
        m = dataclasses.replace(m, vocab_size=pad_vocab_size(GPT2_TOKENS))
    window = args.seq_len or getattr(t, "seq_len", None)
    if window is not None and window > m.seq_len:  # a longer context: a longer position table
        m = dataclasses.replace(m, seq_len=window)
    name = Path(args.config).name.removesuffix(".yaml")  # stem would cut "gpt2-1.5b"
    return Model(name, m, window), layout_options(config)


def hf_model(folder: str, seq_len: int | None) -> Model:
    """A Hugging Face folder's model on meta, counted from its modules (config.json only:
    no weight is read), at `seq_len` (default: 1024 or the model's limit if shorter)."""
    try:
        native = HFCausalLM(folder, read_weights=False)
    except (OSError, ValueError) as error:
        raise PlanError(f"--hf {folder}: {error}") from None
    longest = getattr(native.hf_config, "max_position_embeddings", None) or 1024
    return Model(Path(folder).name, None, seq_len or min(1024, longest), native=native)


def layout_options(config: Config) -> dict[str, Any]:
    """The run's layout in the planner's terms (launch.plan's defaults from a config)."""
    p, t = config.parallel, config.train
    return {
        "tp": p.tp,
        "zero_stage": p.zero_stage,
        "sequence_parallel": p.sequence_parallel,
        "recompute": p.recompute,
        "recompute_every": p.recompute_every,
        "micro_batch": t.micro_batch_size,
        "global_batch": t.global_batch_size,
        "precision": t.precision,
        "grad_reduce_dtype": t.grad_reduce_dtype,
        "overlap_param_gather": p.overlap_param_gather,
    }


def read_config(name: str, overrides: list[str]) -> Config:
    path = Path(name)
    if not path.is_file():
        try:
            path = preset_path(name)
        except ConfigError:
            presets = ", ".join(preset_names())
            raise PlanError(f"unknown preset or config file {name!r}; presets: {presets}") from None
    return load_config(path, overrides)  # its layout is the default; checked again per plan


def chosen(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """The layout options: given on the command line, else the defaults."""
    given = {key: getattr(args, key) for key in defaults if getattr(args, key) is not None}
    return defaults | given


def single(args: argparse.Namespace, model: Model, defaults: dict[str, Any]) -> Plan:
    options = chosen(args, defaults)
    tp = options["tp"]
    if tp == 1 and args.sequence_parallel is None:  # the config's SP needs its own tp
        options["sequence_parallel"] = False
    if tp < 1 or args.gpus % tp:
        raise PlanError(
            f"--gpus {args.gpus} is not divisible by tp={tp}: the GPUs form a dp x tp grid; "
            f"use a multiple of {tp} GPUs or another --tp"
        )
    try:
        layout = Layout(gpus=args.gpus, bucket_mb=args.bucket_mb, **options)
    except ValueError as error:
        hint = "; set --global-batch or --micro-batch" if "global batch" in str(error) else ""
        raise PlanError(f"{error}{hint}") from None
    return model.plan(layout, args)


def search(args: argparse.Namespace, model: Model, defaults: dict[str, Any]) -> list[Plan]:
    """Every valid layout of the free options (those not on the command line); fitting
    ones first by step time (or memory for a bare count), then the rest by memory."""
    fixed = {key: getattr(args, key) for key in defaults if getattr(args, key) is not None}
    bare = model.config is None  # no activations: recomputation and SP change nothing

    def values(key: str, free: Any) -> list[Any]:
        return [fixed[key]] if key in fixed else list(free)

    global_batch = fixed.get("global_batch", defaults["global_batch"])
    plans = []
    for tp in values("tp", (t for t in range(1, args.gpus + 1) if args.gpus % t == 0)):
        per_rank = global_batch // (args.gpus // tp) if global_batch else 1
        choices = itertools.product(
            values("zero_stage", (0, 1, 2, 3)),
            values("sequence_parallel", (False,) if tp == 1 or bare else (False, True)),
            values("recompute", (defaults["recompute"],) if bare else RECOMPUTE_MODES),
            values("micro_batch", (b for b in range(1, per_rank + 1) if per_rank % b == 0)),
        )
        for stage, sp, recompute, micro_batch in choices:
            options = defaults | fixed | {"tp": tp, "zero_stage": stage, "sequence_parallel": sp}
            options |= {"recompute": recompute, "micro_batch": micro_batch}
            try:
                layout = Layout(gpus=args.gpus, bucket_mb=args.bucket_mb, **options)
                plans.append(model.plan(layout, args))
            except ValueError:  # heads not divisible by this tp, batch not divisible...
                continue
    return sorted(plans, key=rank_key)


def rank_key(p: Plan) -> tuple[bool, float, float]:
    """Fitting first, by step time, then by memory (ties: the one with more headroom)."""
    seconds = p.time["step_s"] if p.time else 0.0
    memory = p.memory["total"] or 0.0
    return (not p.fits, seconds if p.fits else 0.0, memory)
