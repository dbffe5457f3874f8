"""Will my job fit, and how fast is one rank? Rehearse one real rank of it here:

    python -m launch.rehearse --config turing-nlg-17b --world 256 [--rank 255]
    python -m launch.rehearse --config gpt3-175b --world 1024 --json out.json
    python -m launch.rehearse --config configs/tiny.yaml --world 4 parallel.tp=2 \
        parallel.zero_stage=3 --compute real --steps 3

One process plays rank R of a world of N (torch's fake process group stands in for the
others): the real model and Engine, with TP, SP, recomputation and the config's ZeRO
stage, at the config's precision (launch.planning.rehearsal). It prints, each next to the
planner's figure (launch.plan) with measured / planned: memory by category at the step's
peak (MemTracker) and the bytes each collective group moved in one step cycle.

`--compute fake` (the default) runs every op on shapes only (torch's FakeTensorMode): the
allocations, FLOPs and collectives of the real run, in seconds on any CPU, whatever its
bf16 kernels. `--compute real` runs the kernels, on CUDA when present, else the CPU, and
also prints the step time, the FLOP rate it achieved, the step time the planner predicts
at that rate and the allocator's peak on CUDA; a one-line estimate of its duration from a
timed matmul comes first. `--layers K` keeps only K transformer layers at full width (the
planner's figures are for the same K layers).

Refused before anything is allocated (one line, exit code 2): a rank outside the world,
a world not divisible by tp, and with real compute a planned peak beyond this machine's
free memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybrid.memory import parse_bytes
from launch.config import ConfigError
from launch.planning.duration import real_compute_estimate
from launch.planning.memory_check import format_bytes, local_device
from launch.planning.rehearsal import RehearsalError, Request, rehearse, with_layers
from launch.planning.search import PlanError, read_config
from launch.train.entry import one_line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m launch.rehearse", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="a preset name from configs/ or a YAML file")
    p.add_argument("overrides", nargs="*", help="config key=value, e.g. parallel.zero_stage=3")
    p.add_argument("--world", type=int, required=True, help="ranks in the job (dp x tp)")
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--steps", type=int, default=2, help="training steps (the first measured)")
    p.add_argument("--layers", type=int, help="only this many transformer layers")
    p.add_argument("--memory-limit", help="memory to fit in, e.g. 16GiB (default: free memory)")
    p.add_argument(
        "--compute",
        choices=("fake", "real"),
        default="fake",
        help="fake (default): every op on shapes only, seconds on any CPU, no time; "
        "real: run the kernels, for the step time and FLOP rate",
    )
    p.add_argument("--json", type=Path, help="also write the report to this file")
    return p.parse_args(argv)


def _gib(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def table(report: dict[str, Any]) -> str:
    """The report as text: memory, time, communication."""
    r, t = report, report["time"]
    lines = [
        f"{r['model']}",
        f"rank {r['rank']} of {r['world']} (tp rank {r['tp_rank']}, dp rank {r['dp_rank']}): "
        f"{r['layout']}, {r['precision']}, on {r['device']} ({r['compute']} compute)",
        "",
        f"memory at the step's peak (planner's peak: {r['peak_moment']})",
        f"  {'category':<12} {'measured':>12} {'planned':>12} {'ratio':>7}",
    ]
    for name, row in r["memory"].items():
        lines.append(
            f"  {name:<12} {_gib(row['measured']):>12} {_gib(row['planned']):>12} "
            f"{_ratio(row['ratio']):>7}"
        )
    if r["allocator_peak"] is not None:
        lines.append(f"  CUDA allocator's peak: {_gib(r['allocator_peak'])}")
    planned = t["planned"]
    flops = (
        f"{t['flops'] / 1e12:.2f} TFLOP planned ({_ratio(t['flops_ratio'])} counted at the "
        "dispatcher)"
    )
    lines.append("")
    if t["step_s"] is None:
        lines.append(
            f"time: not measured (--compute fake: shapes only; --compute real times the "
            f"kernels); one step of this rank: {flops}"
        )
    else:
        timed = f"median of {t['timed_steps']} timed" if t["timed_steps"] else "the instrumented"
        lines += [
            f"time: one step of this rank {t['step_s']:.2f} s ({timed} step"
            f"{'s' if t['timed_steps'] != 1 else ''}), {flops}: {t['tflops']:.2f} TFLOP/s",
            f"  the planner at that rate: step {planned.get('step_s', 0):.2f} s = compute "
            f"{planned.get('compute_s', 0):.2f} + TP {planned.get('tp_s', 0):.2f} + exposed DP "
            f"{planned.get('dp_exposed_s', 0):.2f} s (default links: NVLink 300 GB/s, "
            "IB 25 GB/s)",
        ]
    step = "fake-compute" if r["compute"] == "fake" else "instrumented"
    lines += [
        f"  built in {t['build_s']:.1f} s; first ({step}) step {t['first_step_s']:.2f} s",
        "",
        "bytes sent per step by this rank (ring collectives)",
        f"  {'group':<6} {'measured':>12} {'planned':>12} {'ratio':>7}",
    ]
    for group, row in r["communication"].items():
        lines.append(
            f"  {group:<6} {_gib(row['measured']):>12} {_gib(row['planned']):>12} "
            f"{_ratio(row['ratio']):>7}"
        )
    for name, row in sorted(r["collectives"].items()):
        lines.append(f"    {name}: {row['calls']} calls, {_gib(row['bytes'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = with_layers(read_config(args.config, args.overrides), args.layers)
        name = Path(args.config).name.removesuffix(".yaml")
        try:
            limit = parse_bytes(args.memory_limit, "--memory-limit") if args.memory_limit else None
        except ValueError as error:
            raise RehearsalError(str(error)) from None
        request = Request(config, name, args.world, args.rank, args.steps, limit, args.compute)
        device = local_device()
        if args.compute == "real":
            print(real_compute_estimate(request, device), flush=True)
        # Refusals are raised before the fake world or any tensor exists (rehearsal.check);
        # an error during the run itself is a traceback, not a one-line refusal.
        report = rehearse(request, device)
    except (RehearsalError, ConfigError, PlanError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
