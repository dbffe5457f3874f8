"""Where a step's time goes, per system: torch.profiler over a few steps of the same job
as benchmarks/compare_systems.py runs, split into the kernels every system shares and
what each adds.

    python benchmarks/speed/profile_systems.py [--stages 0 1 2 3 --systems ours deepspeed floor]
    python benchmarks/speed/profile_systems.py --single --out benchmarks/profile_single.md
    python benchmarks/speed/profile_systems.py --quick     # the small model (3.3M parameters)

writes benchmarks/speed/profile.md (`--single`: ours at stage 0 and the plain loop, one process).

Per system (rank 0, one thread, dp=2 or one process, the benchmark's model and batches): the median
step, and per step the self CPU time of
- GEMM (aten::mm, addmm, bmm) and attention (scaled_dot_product_*): the model's math,
  the same kernels on the same shapes in every system (ours runs its own GPT, the others
  the plain-PyTorch twin of it);
- other model math: GELU, layer norm, embedding, softmax/loss, elementwise;
- optimizer: AdamW, gradient norms, clipping;
- copies and fills (gradients into buckets, flattening, zeroing);
- communication: c10d/gloo operators (their issuing; waiting shows under the next line);
- outside any operator: Python, and waiting for collectives (gloo runs them on its own
  threads; a wait inside a gradient hook counts under AccumulateGrad, in "other").
The floor (the plain loop on each rank, nothing synchronised) shows what the model's
math costs when two ranks share the machine: no DP system can be faster than it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: `benchmarks.compare` imports

import torch  # noqa: E402

from benchmarks.compare.common import (  # noqa: E402
    BenchConfig,
    JobSpec,
    forward_backward,
    global_batches,
    local_batch,
)
from benchmarks.compare.worker import trainer_class_of  # noqa: E402
from hybrid.distributed.env import init_distributed, shutdown  # noqa: E402
from hybrid.instruments.local_processes import run_processes  # noqa: E402

CATEGORIES = {
    "GEMM": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("scaled_dot_product",),
    "optimizer": ("adam", "norm", "foreach", "clamp", "Optimizer"),
    "copies and fills": ("aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::clone"),
    "communication": ("c10d", "gloo", "allreduce", "all_gather", "reduce_scatter", "broadcast"),
}
OTHER = "other model math"


def category(name: str) -> str:
    lowered = name.lower()
    for label, keys in CATEGORIES.items():
        if any(key.lower() in lowered for key in keys):
            return label
    return OTHER


def profile_job(spec: JobSpec) -> dict:
    """On every rank: two warm-up steps, then `spec.bench.steps` profiled ones."""
    env = init_distributed()
    torch.set_num_threads(1)
    try:
        trainer = trainer_class_of(spec.system)(spec, torch.device("cpu"))
        batches = [local_batch(b, trainer.dp_rank, spec.dp) for b in global_batches(spec.bench)]
        for x, y in batches[: spec.bench.warmup]:
            forward_backward(trainer, x, y)
            trainer.optimizer_step()
        times = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for x, y in batches[spec.bench.warmup :]:
                tick = time.perf_counter()
                loss = forward_backward(trainer, x, y)
                trainer.optimizer_step()
                float(loss)
                times.append(time.perf_counter() - tick)
        steps = len(times)
        per_category: dict[str, float] = {}
        for event in prof.key_averages():
            label = category(event.key)
            per_category[label] = per_category.get(label, 0.0) + event.self_cpu_time_total
        ms = {label: us / 1e3 / steps for label, us in per_category.items()}
        step_ms = statistics.median(times) * 1e3
        ms["outside any operator"] = max(0.0, sum(times) * 1e3 / steps - sum(ms.values()))
        return {"step_ms": step_ms, "ms": ms}
    finally:
        shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--systems", nargs="+", default=["ours", "deepspeed", "floor"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--single", action="store_true", help="ours and plain, one process")
    parser.add_argument("--recompute", action="store_true", help="full recompute")
    parser.add_argument("--quick", action="store_true", help="the small model, as compare_systems")
    parser.add_argument("--out", type=Path, default=HERE / "profile.md")
    args = parser.parse_args()
    bench = (BenchConfig.quick if args.quick else BenchConfig)(steps=args.steps)
    columns = ["GEMM", "attention", OTHER, *list(CATEGORIES)[2:], "outside any operator"]
    command = " ".join([Path(sys.executable).name, *sys.argv])
    lines = [
        "# Where the step goes",
        "",
        f"Command: `{command}`. {bench.parameter_count() / 1e6:.1f}M parameters "
        f"({bench.n_layer} layers x d_model {bench.d_model}, {bench.global_batch} x "
        f"{bench.seq_len} tokens per step). Rank 0, one thread per rank, ms per step "
        f"({args.steps} profiled steps after 2 warm-up; the profiler adds its own overhead "
        "to every system alike). Columns: see the script's docstring.",
        "",
        "| system | step (median) | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    specs = []
    for stage in [] if args.single else args.stages:
        specs += [
            JobSpec(s, dp=2, stage=stage, recompute=args.recompute, bench=bench)
            for s in args.systems
            if s != "floor"
        ]
    if "floor" in args.systems and not args.single:
        specs.append(JobSpec("floor", dp=2, recompute=args.recompute, bench=bench))
    if args.single:
        specs = [JobSpec(s, recompute=args.recompute, bench=bench) for s in ("ours", "plain")]
    for spec in specs:
        result = run_processes(profile_job, spec.world, spec, timeout_s=600)[0]
        cells = " | ".join(f"{result['ms'].get(c, 0.0):.1f}" for c in columns)
        lines.append(f"| {spec.label} | {result['step_ms']:.1f} | {cells} |")
        print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
