"""What fits where: memory per GPU, communication and step time of a model on a layout.

    python -m launch.plan --config configs/turing-nlg-17b.yaml --gpus 256 --gpu-memory 32GiB \
        [--tp 4 --zero-stage 2 --recompute full --micro-batch 1]
    python -m launch.plan --config turing-nlg-17b --gpus 256 --gpu-memory 32GiB --search
    python -m launch.plan --params 7.5e9 --gpus 64 --zero-stage 1 --json
    python -m launch.plan --config gpt2-1.5b --gpus 64 --gpu-memory 80GB --plot zero.png

The layout defaults to the config's `parallel` and `train` sections; each option overrides
it, and `--search` tries every value of the options not given (tp among the divisors of
the GPU count, ZeRO stage, sequence parallelism, recomputation, micro-batch), listing the
layouts that fit by estimated step time. `--params` plans a bare parameter count: the
ZeRO paper's model-state analysis, without activations. The numbers come from
hybrid.memory: model states and buffers equal the engine's own accounting to the byte, and
the peak of a step is within 10% of MemTracker's measurement of real steps
(tests/test_plan.py, tests/test_plan_instrument.py). The total is that peak plus
`--reserve`; `--backend gloo` plans a CPU run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from hybrid.memory import (
    BACKENDS,
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
    unit_bytes,
)
from launch.config import PRESET_DIR, Config, ConfigError, load_config
from launch.planning.report import report, search_table
from models.gpt import GPTConfig, count_parameters, flops_per_token, pad_vocab_size
from models.gpt.accounting import (
    rank_parameters,
    recompute_flops_per_token,
    transformer_shape,
    with_seq_len,
)
from models.gpt.model import check_tp_shapes

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
    """A preset's model (shape and parameters per tp), or a bare parameter count."""

    name: str
    config: GPTConfig | None
    seq_len: int | None  # the training window
    count: int | None = None

    def parameters(self, tp: int) -> RankParameters:
        if self.config is None:
            return RankParameters.bare(self.count or 0, tp)
        return rank_parameters(self.config, tp)

    def check(self, layout: Layout) -> None:
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
        if self.config is not None:
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
        if self.config is None:
            return f"{format_count(self.count or 0)} parameters (a bare count: model states only)"
        c = self.config
        return (
            f"{self.name}: {format_count(count_parameters(c))} parameters, "
            f"{c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"sequence {self.seq_len or c.seq_len}, vocabulary {c.vocab_size}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a YAML file or a preset name from configs/")
    source.add_argument("--params", help="a bare parameter count, e.g. 7.5e9 or 175B")
    p.add_argument("overrides", nargs="*", help="config key=value, e.g. model.seq_len=2048")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job (dp x tp)")
    p.add_argument("--gpu-memory", help="memory of one GPU with its unit: 32GiB, 80GB")
    p.add_argument("--tp", type=int, help="tensor-parallel degree")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--recompute", choices=RECOMPUTE_MODES)
    p.add_argument("--recompute-every", type=int, help="full recomputation of every k-th layer")
    p.add_argument("--micro-batch", type=int, help="sequences per forward on one GPU")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, help="tokens per training sequence")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the tokenizer's)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"))
    p.add_argument(
        "--grad-reduce-dtype",
        choices=("fp32", "bf16"),
        help="gradient accumulation and reduction dtype (bf16: the 16-bit compute dtype)",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="engine bucket size (MiB)")
    p.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stages 1-2: wait for the step's all-gathers in the next forward (default: yes)",
    )
    p.add_argument("--reserve", default="1GiB", help="kept free for CUDA context, NCCL, etc.")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="nccl",
        help="collectives' backend (gloo: CPU runs; its own collectives copy their buffers)",
    )
    p.add_argument("--peak-tflops", type=float, default=312.0, help="per GPU (A100 bf16: 312)")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak achieved")
    p.add_argument("--intra-node-bandwidth", default="300GB/s", help="per GPU, NVLink")
    p.add_argument("--inter-node-bandwidth", default="25GB/s", help="per GPU, InfiniBand")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--search", action="store_true", help="list every layout that fits")
    p.add_argument("--top", type=int, help="with --search: print only the best N")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", type=Path, help="PNG: memory per GPU against the DP degree")
    p.add_argument("--units", choices=("GiB", "GB"), default="GiB")
    return p.parse_args(argv)


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
    if args.params is not None:
        count = parse_count(args.params, "--params")
        model = Model("bare count", None, None, count)
        defaults = {"tp": 1, "zero_stage": 0, "sequence_parallel": False, "recompute": "none"}
        defaults |= {"recompute_every": 1, "micro_batch": 1, "global_batch": None}
        defaults |= {"precision": "bf16", "grad_reduce_dtype": "fp32", "overlap_param_gather": True}
        return model, defaults
    config = read_config(args.config, args.overrides)
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
        preset = PRESET_DIR / f"{name}.yaml"
        if not preset.is_file():
            presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
            raise PlanError(f"unknown preset or config file {name!r}; presets: {presets}")
        path = preset
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


def plot(path: Path, model: Model, args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Memory per GPU against the DP degree for each ZeRO stage (ZeRO paper, Figure 1 and
    Table 1): model states solid; with a model shape, the total (the step's peak plus
    the reserve) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options = chosen(args, defaults) | {"global_batch": None}
    tp, unit, size = options["tp"], args.units, unit_bytes(args.units)
    degrees = [2**i for i in range(11) if 2**i <= max(args.gpus // tp, 1)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stage, color in zip((0, 1, 2, 3), ("C0", "C1", "C2", "C3"), strict=True):
        layouts = [
            Layout(gpus=dp * tp, bucket_mb=args.bucket_mb, **options | {"zero_stage": stage})
            for dp in degrees
        ]
        plans = [model.plan(layout, args) for layout in layouts]
        states = [p.memory["model_states"] / size for p in plans]
        ax.plot(degrees, states, "-o", color=color, label=f"stage {stage}: model states")
        if model.config is not None:
            total = [p.memory["total"] / size for p in plans]
            ax.plot(degrees, total, "--", color=color, label=f"stage {stage}: total")
    if args.gpu_memory:
        ax.axhline(args.gpu_memory / size, color="k", lw=0.8, label="GPU memory")
    ax.set(xscale="log", yscale="log", xlabel="data-parallel degree", ylabel=f"per GPU ({unit})")
    ax.set_xticks(degrees, [str(d) for d in degrees])
    ax.set_title(f"{model.name}, tp {tp}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, defaults = resolve(args)
        if args.search:
            if args.gpu_memory is None:
                raise PlanError("--search needs --gpu-memory (e.g. 32GiB) to know what fits")
            plans = search(args, model, defaults)
            if args.json:
                print(json.dumps([p.to_dict() for p in plans if p.fits], indent=1))
            else:
                print(model.describe())
                print(search_table(plans, args))
        else:
            result = single(args, model, defaults)
            if args.json:
                print(json.dumps(result.to_dict() | {"model": model.describe()}, indent=1))
            else:
                print(report(result, model.describe(), args))
        if args.plot is not None:
            plot(args.plot, model, args, defaults)
            if not args.json:
                print(f"plot written to {args.plot}")
    except (PlanError, ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
