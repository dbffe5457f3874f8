"""Ours against the plain loop in one process, phase by phase: forward, backward and the
optimizer step timed apart, the two systems alternated step by step in the same process
(the order swapped every round), so a difference of a few percent in one phase shows
where peer_speed.py's whole-step ratio cannot say.

    python benchmarks/speed/one_process_phases.py [--width 57m --rounds 30]
    python benchmarks/speed/one_process_phases.py --profile --rounds 4   # by operator

Prints per phase the median ms of each and the median of the paired ratios (ours / plain)
with [least-largest]; `--profile` adds, per operator (torch.profiler, self CPU time per
step), the 30 operators whose time differs most between the two. One thread, as
peer_speed.py's one-process job runs; the model, batches and optimizer are
benchmarks/compare's (the same trainers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks.compare` imports

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.compare.common import (
    BenchConfig,
    JobSpec,
    global_batches,
    load_lazy_imports,
    local_batch,
)
from benchmarks.compare.jobs import WIDTHS
from benchmarks.compare.worker import trainer_class_of

PHASES = ("forward", "backward", "step")


def timed_step(trainer: object, x: torch.Tensor, y: torch.Tensor) -> tuple[float, ...]:
    """Seconds of forward, backward and the optimizer step."""
    a = time.perf_counter()
    loss = trainer.forward(x, y)
    b = time.perf_counter()
    trainer.backward(loss)
    c = time.perf_counter()
    trainer.optimizer_step()
    return b - a, c - b, time.perf_counter() - c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", choices=sorted(WIDTHS), default="57m")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also by operator")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = replace(BenchConfig(**WIDTHS[args.width]), steps=args.rounds)
    device = torch.device("cpu")
    load_lazy_imports(device)
    trainers = []
    for system in ("ours", "plain"):
        torch.manual_seed(0)
        trainers.append(trainer_class_of(system)(JobSpec(system, bench=bench), device))
    batches = [local_batch(b, 0, 1) for b in global_batches(bench)]
    for trainer in trainers:  # warm-up, untimed
        for x, y in batches[: bench.warmup]:
            timed_step(trainer, x, y)
    times: list[list[tuple[float, ...]]] = [[], []]
    by_operator: list[dict[str, float]] = [{}, {}]
    for r in range(args.rounds):
        x, y = batches[bench.warmup + r]
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            if not args.profile:
                times[i].append(timed_step(trainers[i], x, y))
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                times[i].append(timed_step(trainers[i], x, y))
            for event in prof.key_averages():
                ms = event.self_cpu_time_total / 1e3 / args.rounds
                by_operator[i][event.key] = by_operator[i].get(event.key, 0.0) + ms
    print(f"{args.width}, {args.rounds} rounds, ms per step (ours / plain), ratio [least-largest]")
    rows = [
        (name, [t[k] for t in times[0]], [t[k] for t in times[1]]) for k, name in enumerate(PHASES)
    ]
    rows.append(("whole step", [sum(t) for t in times[0]], [sum(t) for t in times[1]]))
    for name, ours, plain in rows:
        ratios = [a / b for a, b in zip(ours, plain, strict=True)]
        print(
            f"{name:>10}: {statistics.median(ours) * 1e3:7.1f} / "
            f"{statistics.median(plain) * 1e3:7.1f}  {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}-{max(ratios):.3f}]"
        )
    if args.profile:
        names = set(by_operator[0]) | set(by_operator[1])
        gap = {n: by_operator[0].get(n, 0.0) - by_operator[1].get(n, 0.0) for n in names}
        print("\noperator (self CPU ms per step): ours, plain")
        for name in sorted(names, key=lambda n: -abs(gap[n]))[:30]:
            ours, plain = by_operator[0].get(name, 0.0), by_operator[1].get(name, 0.0)
            print(f"  {name[:60]:60s} {ours:8.1f} {plain:8.1f}")


if __name__ == "__main__":
    main()
