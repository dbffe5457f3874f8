"""Step time of ours against every peer, each layout's systems alternated inside one job.

    python benchmarks/speed/peer_speed.py            # 57M and 124M, fp32 and bf16 (where native)
    python benchmarks/speed/peer_speed.py --quick    # the small model, fp32: checks it in minutes

The systems, model, data and optimizer are benchmarks/compare_systems.py's (the same
trainers, benchmarks/compare/peers); what differs is how time is taken. There every
(system, round) is its own torchrun job, and jobs minutes apart differ by what no system
controls: its ranges were +-20-40%. Here one job per layout builds all of that layout's
systems side by side and alternates them step block by step block, the order rotated
every round (benchmarks/compare/alternated.py). Per round, ours / a peer is the ratio of
their blocks in that round; the table gives the median over rounds and the least and
largest ratio, for two clocks:
- wall: the slowest rank's wall time per step (what a user waits for);
- CPU: CPU seconds per step per rank (time.process_time, all threads, gloo's included),
  the mean over ranks. Another tenant's load stretches wall time but hardly the CPU
  time a process is given; at tp=2 x dp=2 the job's 4 processes share 2 cores, so wall
  time there measures the scheduler as much as the systems.
The checks use wall time (what a user waits for) and show CPU time beside it; each says
whether its range is within +-5% of its median. The floor is the plain loop on each DP rank
with no communication (what no DP system can beat); benchmarks/speed/floor_bound.py gives
the least any DP system pays above it on this machine (the step's collectives alone).
Memory is not measured here (the systems share the processes): see
benchmarks/memory_breakdown.py and benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # `benchmarks.compare` imports

from benchmarks.compare.common import BenchConfig, JobSpec, machine  # noqa: E402
from benchmarks.compare.jobs import WIDTHS, deepspeed_available  # noqa: E402
from launch.observe.matmul_rate import native_bf16  # noqa: E402

# One job per layout and stage: (system, dp, tp, stage); ours first. The floor runs beside
# stages 0-2, whose target is within 1.05x of it.
GROUPS = [
    [("ours", 1, 1, 0), ("plain", 1, 1, 0)],
    [("ours", 2, 1, 0), ("ddp", 2, 1, 0), ("deepspeed", 2, 1, 0), ("floor", 2, 1, 0)],
    [("ours", 2, 1, 1), ("deepspeed", 2, 1, 1), ("floor", 2, 1, 0)],
    [("ours", 2, 1, 2), ("deepspeed", 2, 1, 2), ("floor", 2, 1, 0)],
    [("ours", 2, 1, 3), ("deepspeed", 2, 1, 3), ("fsdp2", 2, 1, 3)],
    [("ours", 1, 2, 0), ("dtensor_tp", 1, 2, 0)],
    [("ours", 2, 2, 3), ("fsdp2_tp", 2, 2, 3)],
]
TOLERANCE = 0.05  # a ratio's range must lie within +-5% of its median


def run_group(
    specs: list[JobSpec], rounds: int, block: int, out: Path, timeout_s: float
) -> dict | str:
    """One alternated job; its result, or why it failed (the log's last lines)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(specs[0].world),
        "-m",
        "benchmarks.compare.alternated",
        "--specs",
        json.dumps([s.to_json() for s in specs]),
        "--rounds",
        str(rounds),
        "--block",
        str(block),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU: a GPU would switch init_distributed to nccl
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code == 0 and out.exists():
        return json.loads(out.read_text())
    tail = [line for line in log.read_text().splitlines() if line.strip()][-3:]
    return f"failed ({'timed out' if code == -1 else f'exit {code}'}): {' / '.join(tail)}"


def per_round(result: dict, system: int, clock: str) -> list[float]:
    """Per round, this system's time per step: the slowest rank's wall, the ranks' mean CPU."""
    values = []
    for r in range(result["rounds"]):
        ranks = [
            b[clock]
            for blocks in result["blocks"]
            for b in blocks
            if b["round"] == r and b["system"] == system
        ]
        values.append(max(ranks) if clock == "wall" else statistics.fmean(ranks))  # cpu, faults
    return values


def ratio(result: dict, a: int, b: int, clock: str) -> tuple[float, float, float]:
    """(median, least, largest) over rounds of a's time / b's in the same round."""
    pairs = [
        x / y for x, y in zip(per_round(result, a, clock), per_round(result, b, clock), strict=True)
    ]
    return statistics.median(pairs), min(pairs), max(pairs)


def shown(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}]"


def tight(r: tuple[float, float, float]) -> bool:
    return r[1] >= r[0] * (1 - TOLERANCE) and r[2] <= r[0] * (1 + TOLERANCE)


def loss_gap(result: dict, a: int, b: int) -> float:
    """Largest relative difference of two systems' losses at the same steps."""
    la, lb = result["losses"][a], result["losses"][b]
    return max(abs(x - y) / abs(y) for x, y in zip(la, lb, strict=True))


def report_group(result: dict | str, specs: list[JobSpec]) -> list[str]:
    """Table rows: ours against each other system of the job."""
    layout = specs[0].layout + (f", stage {specs[0].stage}" if specs[0].dp > 1 else "")
    if isinstance(result, str):
        return [f"| {layout} | all | {result} |" + " |" * 7]
    rows = []
    medians = {i: statistics.median(per_round(result, i, "wall")) for i in range(len(specs))}
    peers = [i for i, s in enumerate(specs) if s.system not in ("ours", "floor")]
    fastest = min(peers, key=medians.get) if peers else None
    for i in range(1, len(specs)):
        wall, cpu = ratio(result, 0, i, "wall"), ratio(result, 0, i, "cpu")
        target = 1.05 if specs[i].system == "floor" else 1.0
        role = "floor" if specs[i].system == "floor" else "fastest peer" if i == fastest else "peer"
        verdict = "PASS" if wall[0] <= target else "FAIL"
        spread = "yes" if tight(wall) else "no"
        gap = "-" if specs[i].system == "floor" else f"{loss_gap(result, 0, i):.1e}"
        faults = [statistics.median(per_round(result, j, "faults")) / 1e3 for j in (0, i)]
        rows.append(
            f"| {layout} | {specs[i].label.split(',')[0]} ({role}) | {medians[0] * 1e3:.0f} / "
            f"{medians[i] * 1e3:.0f} | {shown(wall)} | {spread} | {shown(cpu)} "
            f"| {'yes' if tight(cpu) else 'no'} | <= {target:.2f}: {verdict} | {gap} "
            f"| {faults[0]:.1f} / {faults[1]:.1f} |"
        )
    return rows


def section(
    bench: BenchConfig, name: str, rounds: int, block: int, raw: Path, groups: list[int]
) -> list[str]:
    systems_ok, why = deepspeed_available(sys.executable)
    lines = [
        f"### {name}, {bench.precision}",
        "",
        "| layout | ours / | ms per step (ours / it) | wall ratio [least-largest] | +-5% "
        "| CPU ratio [least-largest] | +-5% | check (wall) | losses' largest gap "
        "| page faults per step, thousands (ours / it) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group in (GROUPS[g] for g in groups):
        specs = [JobSpec(s, dp, tp, st, False, bench) for s, dp, tp, st in group]
        if not systems_ok:
            specs = [s for s in specs if s.system != "deepspeed"]
        tick = time.perf_counter()
        out = raw / f"{name}_{bench.precision}_{specs[0].layout}_{specs[0].stage}.json".replace(
            " ", ""
        )
        result = run_group(specs, rounds, block, out, timeout_s=1800)
        lines += report_group(result, specs)
        print(lines[-1], f"({time.perf_counter() - tick:.0f} s)", flush=True)
    if not systems_ok:
        lines += ["", f"DeepSpeed absent: {why}."]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, fp32, fewer rounds")
    parser.add_argument("--widths", nargs="+", choices=sorted(WIDTHS), default=["57m", "124m"])
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--rounds", type=int, help="default 6")
    parser.add_argument("--block", type=int, default=1, help="consecutive steps per system")
    parser.add_argument(
        "--groups", nargs="+", type=int, default=list(range(len(GROUPS))), help="GROUPS indices"
    )
    parser.add_argument("--out", type=Path, default=HERE / "peer_speed.md")
    parser.add_argument("--raw", type=Path, default=Path("/tmp/peer_speed"))
    args = parser.parse_args()
    rounds = args.rounds or 6
    native, detail = native_bf16()
    precisions = args.precisions or (["fp32", "bf16"] if native and not args.quick else ["fp32"])
    started = time.perf_counter()
    lines = [
        "# Step time against the peers, alternated inside one job per layout",
        "",
        f"`{' '.join(['python', *sys.argv])}`: {rounds} rounds x {args.block} step(s) per "
        f"system per round (benchmarks/speed/peer_speed.py says how). {detail}"
        + ("" if native else ": the bf16 pairs are absent (they would time emulated kernels)")
        + ".",
        "",
    ]
    widths = ["quick"] if args.quick else args.widths
    for name in widths:
        for precision in precisions:
            if precision == "bf16" and not native:
                continue
            base = BenchConfig.quick() if name == "quick" else BenchConfig(**WIDTHS[name])
            steps = rounds * args.block
            bench = replace(base, precision=precision, steps=steps, ours_draws_weights=False)
            lines += section(bench, name, rounds, args.block, args.raw, args.groups)
    info = machine()
    lines += [
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gb']} GB; torch "
        f"{info['torch']}; whole run {(time.perf_counter() - started) / 60:.1f} min.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
