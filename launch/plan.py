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
(tests/planning/test_plan.py, tests/planning/test_plan_instrument.py). The total is that peak plus
`--reserve`; `--backend gloo` plans a CPU run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybrid.memory import (
    BACKENDS,
    RECOMPUTE_MODES,
    Layout,
    unit_bytes,
)
from launch.config import ConfigError
from launch.planning.report import report, search_table
from launch.planning.search import Model, PlanError, chosen, resolve, search, single


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a YAML file or a preset name from configs/")
    source.add_argument("--params", help="a bare parameter count, e.g. 7.5e9 or 175B")
    source.add_argument(
        "--hf", help="a Hugging Face model folder (config.json), trained as it is (tp=1)"
    )
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
    p.add_argument(
        "--bucket-mb", type=float, help="engine bucket size (MiB; default: the config's, or 25)"
    )
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
