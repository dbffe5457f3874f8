"""Rehearsals of one rank of large jobs on this machine, against the planner.

    python benchmarks/rehearsal.py [--only turing] [--out benchmarks/rehearsal.md]
    python benchmarks/rehearsal.py --quick   # a small model, to try the script (seconds)
    python benchmarks/rehearsal.py --compute real --only turing   # kernels run (hours on AVX2)

Each case is its own `python -m launch.rehearse ... --json` process (launch.rehearse):
the real model and Engine of one rank, the rest of the world a fake process group, in the
default fake-compute mode (every op on shapes only: hybrid/instruments/fake_compute.py);
memory measured by MemTracker, FLOPs and collective bytes of one step cycle counted at
torch's dispatcher, each next to the planner's figure. The cases, whole models at the
presets' own batch, each at rank 0 and the last rank:
- turing-nlg-17b, world 256, tp 4, ZeRO-2, SP, full recomputation: 78 layers, 8
  micro-batches a step;
- gpt3-175b, world 1024, tp 8, ZeRO-3, SP, selective recomputation: 96 layers, 12
  micro-batches;
- llama-70b (GQA, SwiGLU, RoPE, RMSNorm), world 512, tp 8, ZeRO-3, SP, full
  recomputation: 80 layers, 8 micro-batches of 2.
Each process's wall time is measured here, from outside (the acceptance: under 120 s on
2 cores). `--reuse` takes the cases of an earlier benchmarks/raw/rehearsal.json that it
would run again unchanged.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

# (label, preset, world, rank, extra arguments and overrides)
CASES = [
    ("turing", "turing-nlg-17b", 256, 0, []),
    ("turing", "turing-nlg-17b", 256, 255, []),
    ("gpt3", "gpt3-175b", 1024, 0, []),
    ("gpt3", "gpt3-175b", 1024, 1023, []),
    ("llama", "llama-70b", 512, 0, []),
    ("llama", "llama-70b", 512, 511, []),
]
QUICK = [
    ("quick", "configs/tiny.yaml", 4, 0, ["parallel.tp=2", f"parallel.zero_stage={stage}"])
    for stage in (0, 3)
]
TOLERANCE = 0.05  # the acceptance: every category and the peak within 5% of the planner
TIME_LIMIT_S = 120  # the acceptance: each rehearsal (fake compute) under 2 minutes


def command(
    preset: str, world: int, rank: int, extra: list[str], steps: int, out: Path
) -> list[str]:
    line = [sys.executable, "-m", "launch.rehearse", "--config", preset]
    line += ["--world", str(world), "--rank", str(rank), "--steps", str(steps)]
    return [*line, *extra, "--json", str(out)]


def key(line: list[str]) -> tuple[str, ...]:
    """A case's command without the interpreter and the report's path."""
    return tuple(line[1:-2] if line[0] == sys.executable else line[:-2])


def run_case(preset: str, world: int, rank: int, extra: list[str], steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        line = command(preset, world, rank, extra, steps, out)
        print("$", " ".join(line[1:]), flush=True)
        started = time.perf_counter()
        done = subprocess.run(line, cwd=ROOT, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        print(done.stdout, done.stderr[-2000:], sep="\n", flush=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1], "command": line[1:]}
        return json.loads(out.read_text()) | {"command": line[1:], "wall_s": wall_s}


def _number(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def within(report: dict[str, Any]) -> bool:
    """Every category's and the peak's ratio within the tolerance; a category empty in
    both is exact, one empty in the plan alone is not."""
    for row in report["memory"].values():
        tiny = max(row["measured"], row["planned"]) < 2**20  # below 1 MiB: noise of counters
        if not tiny and (row["ratio"] is None or abs(row["ratio"] - 1) > TOLERANCE):
            return False
    return True


def _wall(report: dict[str, Any]) -> str:
    """The process's wall time, in bold past the limit (fake compute only has one)."""
    wall = report.get("wall_s")
    if wall is None:
        return "-"
    late = report.get("compute") == "fake" and wall > TIME_LIMIT_S
    return f"**{wall:.0f}**" if late else f"{wall:.0f}"


def markdown(reports: list[dict[str, Any]]) -> str:
    lines = [
        "# Rehearsals: one real rank of a large job, against the planner",
        "",
        f"`python benchmarks/rehearsal.py` on {platform.processor() or 'CPU'}"
        f" with {torch.get_num_threads()} threads, torch {torch.__version__}. Each row is one "
        "`python -m launch.rehearse` run (its command below): the real model and Engine of "
        "that rank, the rest of the world a fake process group. Memory at the step's peak "
        "by category, measured by MemTracker with the engine's storages filed by what they "
        "are (hybrid/instruments/engine_memory.py), in GiB, measured / planned; the "
        "planner's peak moment in the last column. Micro-batches per step as the layout "
        "says (see the script's "
        "docstring).",
        "",
        "| case | rank | parameters | gradients | optimizer | activations | buffers | peak "
        "| within 5% | planner's peak | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        if "error" in r:
            lines.append(f"| {' '.join(r['command'][3:])} | error: {r['error']} |||||||||")
            continue
        cells = [
            f"{_gib(row['measured'])} / {_gib(row['planned'])}"
            + (f" ({row['ratio']:.3f})" if row["ratio"] is not None else "")
            for row in r["memory"].values()
        ]
        lines.append(
            f"| {r['config']}: {r['layout']} "
            f"| {r['rank']} | {' | '.join(cells)} | {'yes' if within(r) else '**no**'} "
            f"| {r['peak_moment']} | {_wall(r)} |"
        )
    lines += [
        "",
        "## Time and communication",
        "",
        "Step time of this rank measured bare (after the instrumented step; none in fake "
        "compute); the FLOPs the "
        "planner counts for it, and the share of them counted at torch's dispatcher "
        "(hybrid/instruments/dispatch_counters.py); the FLOP rate achieved; the planner's "
        "step time at that rate with its default links (NVLink 300 GB/s, InfiniBand 25 GB/s "
        "per GPU). "
        "Bytes sent per step by this rank (ring collectives), counted at the dispatcher, "
        "against the planner's.",
        "",
        "| case | rank | step (s) | TFLOP planned | counted / planned | TFLOP/s "
        "| planner's step at that rate (s) | DP GiB measured / planned "
        "| TP GiB measured / planned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        if "error" in r:
            continue
        t, c = r["time"], r["communication"]
        lines.append(
            f"| {r['config']}: {r['layout']} | {r['rank']} "
            f"| {_number(t['step_s'], 2)} | {t['flops'] / 1e12:.2f} | {t['flops_ratio']:.3f} "
            f"| {_number(t['tflops'], 3)} | {_number(t['planned'].get('step_s'), 2)} "
            f"| {_gib(c['dp']['measured'])} / {_gib(c['dp']['planned'])} "
            f"| {_gib(c['tp']['measured'])} / {_gib(c['tp']['planned'])} |"
        )
    gpu = [r for r in reports if r.get("allocator_peak") is not None]
    if gpu:
        lines += ["", "CUDA allocator's peak (GiB): " + ", ".join(
            f"{r['config']} rank {r['rank']}: {_gib(r['allocator_peak'])}" for r in gpu
        )]  # fmt: skip
    lines += ["", "## Commands", ""]
    lines += [f"- `python {' '.join(r['command'][:-2])}`" for r in reports]  # without --json
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted({c[0] for c in CASES}), nargs="+")
    parser.add_argument("--quick", action="store_true", help="a small model, to try it")
    parser.add_argument("--steps", type=int, default=1, help="2 or more for real compute")
    parser.add_argument("--compute", choices=("fake", "real"), default="fake")
    parser.add_argument("--reuse", type=Path, help="an earlier raw/rehearsal.json: skip its cases")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "rehearsal.md")
    args = parser.parse_args()
    cases = QUICK if args.quick else [c for c in CASES if not args.only or c[0] in args.only]
    cases = [(*c[:4], [*c[4], "--compute", args.compute]) for c in cases]
    started = time.perf_counter()
    done = {}
    if args.reuse is not None:  # finished cases of an earlier run, by their command
        done = {key(r["command"]): r for r in json.loads(args.reuse.read_text())}
    reports = []
    for case in cases:
        previous = done.get(key(command(*case[1:], args.steps, Path("-"))))
        reports.append(previous or run_case(*case[1:], args.steps))
    minutes = (time.perf_counter() - started) / 60
    args.out.write_text(markdown(reports))
    (args.out.parent / "raw").mkdir(exist_ok=True)
    (args.out.parent / "raw" / f"{args.out.stem}.json").write_text(json.dumps(reports, indent=1))
    print(f"written {args.out} in {minutes:.1f} min")
    fast = all(r.get("wall_s", 0) <= TIME_LIMIT_S for r in reports if r.get("compute") == "fake")
    return 0 if fast and all("error" not in r and within(r) for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
