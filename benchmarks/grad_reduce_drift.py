"""Drift from fp32 of bf16 training with fp32 against bf16 gradient reduction, on the demo.

    python benchmarks/grad_reduce_drift.py [--steps 300 --zero-stage 0]

Three runs of configs/tiny.yaml from the same seed, each `torchrun --standalone
--nproc_per_node 2 -m launch.pretrain` (dp = 2, gloo), with 4 micro-batches per rank per
step (train.micro_batch_size=2, train.global_batch_size=16): fp32; bf16 with
train.grad_reduce_dtype=fp32 (gradients accumulated and reduced in fp32, the default);
bf16 with train.grad_reduce_dtype=bf16 (accumulated and reduced in bf16). Reported: the
mean training loss of the last 20 steps (from each run's metrics.jsonl) and its gap to
fp32's, absolute and relative. Written to benchmarks/grad_reduce_drift.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {  # name -> (train.precision, train.grad_reduce_dtype)
    "fp32": ("fp32", "fp32"),
    "bf16, fp32 reduction": ("bf16", "fp32"),
    "bf16, bf16 reduction": ("bf16", "bf16"),
}
LAST = 20


def run(precision: str, reduce: str, steps: int, stage: int, run_dir: Path) -> list[float]:
    """The per-step training losses of one run."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "launch.pretrain", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"train.steps={steps}", f"train.precision={precision}",
        f"train.grad_reduce_dtype={reduce}", "train.micro_batch_size=2",
        "train.global_batch_size=16", f"train.eval_every={steps}",
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
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    args = parser.parse_args()
    means, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (precision, reduce)) in enumerate(RUNS.items()):
            start = time.perf_counter()
            losses = run(precision, reduce, args.steps, args.zero_stage, Path(tmp) / str(i))
            seconds[name] = time.perf_counter() - start
            assert len(losses) == args.steps, (name, len(losses))
            tail = losses[-LAST:]
            means[name] = sum(tail) / len(tail)
    base = means["fp32"]
    lines = [
        f"configs/tiny.yaml, {args.steps} steps, dp=2 (gloo), ZeRO stage {args.zero_stage}, "
        "4 micro-batches of 2 sequences per rank per step (global batch 16); "
        f"mean training loss of the last {LAST} steps (metrics.jsonl).",
        "",
        "| run | loss (last 20) | gap to fp32 | relative | wall (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, mean in means.items():
        gap = mean - base
        lines.append(
            f"| {name} | {mean:.5f} | {gap:+.5f} | {gap / base:+.3%} | {seconds[name]:.0f} |"
        )
    closer = abs(means["bf16, fp32 reduction"] - base) < abs(means["bf16, bf16 reduction"] - base)
    lines += ["", f"fp32 reduction closer to fp32 than bf16 reduction: {closer}"]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(f"# Gradient reduction dtype: drift from fp32\n\n{text}\n")


if __name__ == "__main__":
    main()
