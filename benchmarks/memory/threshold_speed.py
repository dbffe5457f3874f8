"""What glibc's mmap threshold costs a step: one system's job under two thresholds, alternated.

    python benchmarks/memory/threshold_speed.py [--rounds 4] [--tp 2] [--a 1048576 --b 786432]

hybrid/distributed/host_memory.py fixes the threshold at 768 KiB, under a tp=2 rank's
768 KiB attention blocks of the 57M model, so they leave the heap instead of fragmenting it
(benchmarks/memory/heap_growth.md); each such block then costs a page fault per page. This
runs the comparison's ours job (benchmarks/compare: the same trainer, model and data) as
its own torchrun job per threshold, set through MALLOC_MMAP_THRESHOLD_ (which the engine
then leaves alone), the order swapped every round, and prints per round the slowest rank's
median step time under each and their ratio b / a, then the median ratio [least-largest]
and each threshold's peak RSS above baseline (the worst rank, median over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compare.common import BenchConfig, JobSpec  # noqa: E402
from benchmarks.compare.jobs import WIDTHS, launch  # noqa: E402
from hybrid.distributed.host_memory import THRESHOLD_BYTES  # noqa: E402


def timed_job(spec: JobSpec, threshold: int, python: str, folder: Path) -> tuple[float, float]:
    """(slowest rank's median step time s, largest peak RSS above baseline bytes)."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    try:
        ranks = launch(spec, python, folder, timeout_s=900.0, device="cpu")
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    if isinstance(ranks, str):
        raise RuntimeError(f"threshold {threshold}: {ranks}")
    peak = max(r["peak"]["peak_above_baseline"] for r in ranks)
    return max(r["median_time"] for r in ranks), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job")
    parser.add_argument("--width", choices=sorted(WIDTHS), default="57m")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--a", type=int, default=1 << 20, help="reference threshold, bytes")
    parser.add_argument(
        "--b", type=int, default=THRESHOLD_BYTES, help="threshold measured (the engine's), bytes"
    )
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    bench = BenchConfig(**WIDTHS[args.width], steps=args.steps)
    spec = JobSpec("ours", dp=args.dp, tp=args.tp, stage=args.stage, bench=bench)
    ratios: list[float] = []
    peaks: dict[int, list[float]] = {args.a: [], args.b: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = (args.a, args.b) if r % 2 == 0 else (args.b, args.a)
            times = {}
            for threshold in order:
                folder = Path(tmp) / f"{r}_{threshold}"
                times[threshold], peak = timed_job(spec, threshold, args.python, folder)
                peaks[threshold].append(peak)
            ratios.append(times[args.b] / times[args.a])
            print(
                f"round {r}: {args.a} B {times[args.a] * 1e3:.0f} ms, {args.b} B "
                f"{times[args.b] * 1e3:.0f} ms, ratio {ratios[-1]:.3f}",
                flush=True,
            )
    print(
        f"{spec.label}, {args.width}: step time at {args.b} B / at {args.a} B: "
        f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] over "
        f"{args.rounds} rounds; peak RSS above baseline (MiB) "
        + ", ".join(f"{t} B {statistics.median(p) / 2**20:.1f}" for t, p in peaks.items())
    )


if __name__ == "__main__":
    main()
