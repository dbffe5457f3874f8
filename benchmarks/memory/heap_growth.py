"""Where the tp=2 pair's extra resident memory lives: glibc's main heap, step by step.

    python benchmarks/memory/heap_growth.py [--steps 30] [--systems ours dtensor_tp]

At a 1 MiB mmap threshold the 57M breakdown (benchmarks/memory_breakdown.md) had ours at
tp=2 1.039x DTensor TP in peak RSS with the same tensors at the peak to the byte
(MemTracker); this found why (heap_growth.md), and the engine's threshold is now 768 KiB.
This runs each system's tp=2 job for many steps in the same trainer the comparison uses
and reads, after every step, from outside the code under test: the resident size of the
`[heap]` mapping (/proc/self/smaps: the main arena, which serves every allocation under
the mmap threshold made on the main thread; hybrid/distributed/host_memory.py sets it for
every system), the RSS before the step, and the step's peak (VmHWM, reset before it). A
heap that grows while the live tensors stay the same is free space the allocator keeps but
cannot reuse: fragmentation, not memory the step needs.

Each system is its own torchrun job of 2 processes; the table shows, per system, the
largest rank's heap and absolute step peak at a few steps, and the median over the last
third of the steps (the steady state). Writes benchmarks/memory/heap_growth.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2**20


def mmap_threshold() -> str:
    """The glibc mmap threshold every rank runs under: the environment's, else the engine's."""
    from hybrid.distributed.host_memory import THRESHOLD_BYTES

    value = int(os.environ.get("MALLOC_MMAP_THRESHOLD_", THRESHOLD_BYTES))
    return f"{value // 1024} KiB" + (
        " (MALLOC_MMAP_THRESHOLD_)" if "MALLOC_MMAP_THRESHOLD_" in os.environ else ""
    )


def heap_rss() -> int:
    """Resident bytes of the `[heap]` mapping (glibc's main arena), 0 if there is none."""
    total, in_heap = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                in_heap = len(fields) > 5 and fields[5] == "[heap]"
            elif in_heap and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def rank_main(system: str, steps: int, out: Path) -> None:
    """On every rank: build `system` at tp=2 (57M model), step `steps` times, record."""
    import torch

    from benchmarks.compare.common import (
        BenchConfig,
        JobSpec,
        forward_backward,
        global_batches,
        load_lazy_imports,
        local_batch,
    )
    from benchmarks.compare.jobs import WIDTHS
    from benchmarks.compare.metrics import current_rss, peak_rss, reset_peak_rss
    from benchmarks.compare.worker import trainer_class_of
    from hybrid.distributed.env import init_distributed, shutdown

    torch.set_num_threads(1)
    spec = JobSpec(system, 1, 2, 0, False, BenchConfig(**WIDTHS["57m"]))
    trainer_class = trainer_class_of(system)
    env = init_distributed()
    try:
        torch.manual_seed(0)
        batches = global_batches(spec.bench)
        load_lazy_imports(torch.device("cpu"))
        trainer = trainer_class(spec, torch.device("cpu"))
        local = [local_batch(b, trainer.dp_rank, spec.dp) for b in batches]
        rows = []
        for i in range(steps):
            x, y = local[i % len(local)]
            before = current_rss()
            reset_peak_rss()
            loss = forward_backward(trainer, x, y)
            trainer.optimizer_step()
            del loss
            rows.append(dict(step=i, before=before, peak=peak_rss(), heap=heap_rss()))
        (out / f"rank{env.rank}.json").write_text(json.dumps(rows))
    finally:
        shutdown(env)


def run_system(system: str, steps: int, python: str) -> list[list[dict]]:
    with tempfile.TemporaryDirectory() as folder:
        command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
        command += ["2", str(Path(__file__).resolve()), "--rank-job", system]
        command += ["--steps", str(steps), "--out", folder]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{system} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"))]


def report(results: dict[str, list[list[dict]]], steps: int, minutes: float) -> str:
    shown = sorted({0, 1, 4, steps // 3, 2 * steps // 3, steps - 1})
    steady = range(2 * steps // 3, steps)
    lines = [
        "# glibc's main heap per step at tp=2, ours next to DTensor TP",
        "",
        f"Command: `python benchmarks/memory/heap_growth.py --steps {steps}` ({minutes:.1f} "
        "min). 57M model (benchmarks/compare, the comparison's trainers), tp=2, fp32, mmap "
        f"threshold {mmap_threshold()}. Per system the largest rank at each step (MiB): "
        "`[heap]` resident after the step, and the step's absolute peak RSS; steady = median "
        "over the last third of the steps.",
        "",
        "| system | " + " | ".join(f"step {s}" for s in shown) + " | steady |",
        "|---|" + "---:|" * (len(shown) + 1),
    ]
    for system, ranks in results.items():
        for key, label in (("heap", "heap"), ("peak", "step peak")):
            per_step = [max(r[s][key] for r in ranks) / MiB for s in range(steps)]
            cells = [f"{per_step[s]:.0f}" for s in shown]
            steady_value = statistics.median(per_step[s] for s in steady)
            lines.append(f"| {system} {label} | " + " | ".join(cells) + f" | {steady_value:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--systems", nargs="+", default=["ours", "dtensor_tp"])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)  # one rank of a job
    args = parser.parse_args()
    if args.rank_job:
        rank_main(args.rank_job, args.steps, args.out)  # args.out: its folder
        return
    if args.steps < 6:
        raise SystemExit("--steps must be at least 6: the steady state is the last third")
    started = time.time()
    results = {s: run_system(s, args.steps, args.python) for s in args.systems}
    text = report(results, args.steps, (time.time() - started) / 60)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
