"""Drift from fp32 of bf16 training with fp32 against bf16 gradient reduction, on the demo.

    python benchmarks/precision/grad_reduce_drift.py [--steps 300 --zero-stage 0 \
        --seeds 1234 1 2 ...]

For each seed, three runs of configs/tiny.yaml from that seed, each `torchrun --standalone
--nproc_per_node 2 -m launch.pretrain` (dp = 2, gloo), with 4 micro-batches per rank per
step (train.micro_batch_size=2, train.global_batch_size=16): fp32; bf16 with
train.grad_reduce_dtype=fp32 (gradients accumulated and reduced in fp32, the default);
bf16 with train.grad_reduce_dtype=bf16 (accumulated and reduced in bf16). Reported, per
seed: the mean training loss of the last 20 steps (from each run's metrics.jsonl) and its
gap to fp32's, absolute and relative; over the seeds: the mean absolute gap of each bf16
run, on how many seeds fp32 reduction is the closer, and the paired per-seed difference
of the two runs' absolute gaps with its standard error. A bf16 run leaves fp32's
trajectory within tens of steps either way (rounding in the forward alone does), so one
seed's last-20 gap is mostly that divergence; the seeds (10 by default, about 20 minutes
on 2 cores) average it out, and the standard error says how far. Written to
benchmarks/precision/grad_reduce_drift.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = {  # name -> (train.precision, train.grad_reduce_dtype)
    "fp32": ("fp32", "fp32"),
    "bf16, fp32 reduction": ("bf16", "fp32"),
    "bf16, bf16 reduction": ("bf16", "bf16"),
}
LAST = 20


def run(
    precision: str, reduce: str, steps: int, stage: int, seed: int, run_dir: Path
) -> list[float]:
    """The per-step training losses of one run."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "launch.pretrain", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"train.steps={steps}", f"train.precision={precision}",
        f"train.grad_reduce_dtype={reduce}", "train.micro_batch_size=2",
        "train.global_batch_size=16", f"train.eval_every={steps}", f"train.seed={seed}",
        f"parallel.zero_stage={stage}", f"run_dir={run_dir}", "tracking.wandb.mode=disabled",
        "sample.tokens=0",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{precision}/{reduce} run failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, *range(1, 10)])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    args = parser.parse_args()
    lines = [
        f"configs/tiny.yaml, {args.steps} steps, dp=2 (gloo), ZeRO stage {args.zero_stage}, "
        "4 micro-batches of 2 sequences per rank per step (global batch 16); "
        f"mean training loss of the last {LAST} steps (metrics.jsonl).",
        "",
        "| seed | run | loss (last 20) | gap to fp32 | relative | wall (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    gaps: dict[str, list[float]] = {name: [] for name in RUNS if name != "fp32"}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            means = {}
            for i, (name, (precision, reduce)) in enumerate(RUNS.items()):
                start = time.perf_counter()
                folder = Path(tmp) / f"{seed}-{i}"
                losses = run(precision, reduce, args.steps, args.zero_stage, seed, folder)
                seconds = time.perf_counter() - start
                assert len(losses) == args.steps, (name, len(losses))
                means[name] = statistics.fmean(losses[-LAST:])
                gap = means[name] - means["fp32"]
                if name != "fp32":
                    gaps[name].append(gap / means["fp32"])
                lines.append(
                    f"| {seed} | {name} | {means[name]:.5f} | {gap:+.5f} | "
                    f"{gap / means['fp32']:+.3%} | {seconds:.0f} |"
                )
                print(lines[-1], flush=True)
    fp32_side, bf16_side = gaps["bf16, fp32 reduction"], gaps["bf16, bf16 reduction"]
    closer = sum(abs(a) < abs(b) for a, b in zip(fp32_side, bf16_side, strict=True))
    lines += [
        "",
        "| over the seeds | mean abs relative gap | mean relative gap |",
        "|---|---:|---:|",
    ]
    for name, values in gaps.items():
        magnitude = statistics.fmean(abs(v) for v in values)
        lines.append(f"| {name} | {magnitude:.3%} | {statistics.fmean(values):+.3%} |")
    lines += [
        "",
        f"fp32 reduction closer to fp32 than bf16 reduction on {closer} of {len(args.seeds)} "
        "seeds; in the mean absolute gap: "
        f"{statistics.fmean(map(abs, fp32_side)) < statistics.fmean(map(abs, bf16_side))}",
    ]
    # The seeds' trajectories diverge either way, so the difference of the two settings is
    # judged against its own spread: the paired per-seed difference and its standard error.
    paired = [abs(a) - abs(b) for a, b in zip(fp32_side, bf16_side, strict=True)]
    if len(paired) > 1:
        error = statistics.stdev(paired) / len(paired) ** 0.5
        lines.append(
            f"Per seed, |gap| with fp32 reduction minus |gap| with bf16 reduction: mean "
            f"{statistics.fmean(paired):+.3%}, standard error {error:.3%} (negative: fp32 "
            "reduction the closer)."
        )
    text = "\n".join(lines)
    print(text)
    args.out.write_text(f"# Gradient reduction dtype: drift from fp32\n\n{text}\n")


if __name__ == "__main__":
    main()
