"""How close any data-parallel system can come to the no-communication floor on this machine.

    python benchmarks/speed/floor_bound.py [--results benchmarks/raw/results.json]

The floor of benchmarks/results.md is the plain loop on each of the two DP ranks with no
communication at all. A real DP step must also reduce the gradients of every parameter
once (stages 0-2: an all-reduce, or a reduce-scatter and an all-gather). With two ranks on
two cores, the cores that compute also run the collective, so its CPU time is step time
lost however well it overlaps: no system can beat

    floor step + CPU time of the step's collectives

This measures those collectives alone, on the benchmark model's parameter count in fp32,
in two gloo processes (benchmarks/speed/zero_speed.collective_costs: the median of 20
calls after a warm-up, CPU time of the process with gloo's threads): gloo's all-reduce
(stage 0, DDP), and the pairwise reduce-scatter + all-gather the engine runs at stages
1-2. With `--results` it divides by the floor's step from that comparison (the median
over its rounds) and prints each bound as a ratio to the floor, beside the 1.05 target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from benchmarks.compare.common import BenchConfig
from benchmarks.speed.zero_speed import collective_costs
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.instruments.local_processes import run_processes


def _job(numel: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    env = init_distributed()
    try:
        return collective_costs(numel)
    finally:
        shutdown(env)


def floor_step_ms(results: Path, key: str = "median_time") -> float | None:
    """The floor's step (ms) in a compare_systems raw file: per round the slowest rank's
    median step (`key`: wall time, or "median_cpu_time"), the median over rounds."""
    for row in json.loads(results.read_text())["rows"]:
        if row["spec"]["system"] == "floor" and row["rounds"]:
            steps = [max(rank[key] for rank in ranks) for ranks in row["rounds"]]
            return statistics.median(steps) * 1e3
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="the model's (57M: 8)")
    parser.add_argument("--results", type=Path, help="compare_systems' raw results.json")
    parser.add_argument("--floor-ms", type=float, help="the floor's step, if not in --results")
    args = parser.parse_args()
    numel = BenchConfig(n_layer=args.layers).parameter_count()
    costs = run_processes(_job, 2, numel, timeout_s=900)
    cost = {k: statistics.median(r[k]["cpu"] for r in costs) * 1e3 for k in costs[0]}
    wall = {k: statistics.median(r[k]["wall"] for r in costs) * 1e3 for k in costs[0]}
    stage0 = cost["all_reduce"]
    stages12 = cost["pairwise reduce_scatter"] + cost["pairwise all_gather"]
    print(f"{numel / 1e6:.1f}M fp32 parameters over 2 gloo ranks, per call (CPU / wall ms):")
    for name in cost:
        print(f"  {name}: {cost[name]:.0f} / {wall[name]:.0f}")
    floors = {"wall": args.floor_ms}
    if args.results:
        floors = {
            "wall": floor_step_ms(args.results),
            "CPU": floor_step_ms(args.results, "median_cpu_time"),
        }
    for kind, floor in floors.items():
        if floor is None:
            continue
        print(f"floor step ({kind} time): {floor:.0f} ms")
        print(f"  bound, stage 0 and DDP / floor >= {1 + stage0 / floor:.3f} (target 1.05)")
        print(f"  bound, stages 1-2 / floor >= {1 + stages12 / floor:.3f} (target 1.05)")


if __name__ == "__main__":
    main()
