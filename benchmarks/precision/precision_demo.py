"""bf16 (and fp16) against fp32 on the CPU demo: 100 steps of configs/tiny.yaml at dp=2.

    python benchmarks/precision/precision_demo.py [--steps 100 --zero-stage 2 \
        --precisions fp32 bf16]

Each precision runs `torchrun --standalone --nproc_per_node 2 -m launch.pretrain` from the
same seed; printed: the mean training loss over the last 10 steps and the final validation
loss, and their relative difference to fp32. bf16 keeps fp32 master weights and Adam
moments (hybrid.engine), so it should stay within a few per cent of fp32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(precision: str, steps: int, stage: int, run_dir: Path) -> tuple[float, float]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "launch.pretrain", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"train.steps={steps}", f"train.precision={precision}",
        f"parallel.zero_stage={stage}", f"run_dir={run_dir}", "tracking.wandb.mode=disabled",
        "sample.tokens=0",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{precision} run failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r["loss"] for r in rows[-10:]]
    return sum(last) / len(last), rows[-1]["val_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {p: run(p, args.steps, args.zero_stage, Path(tmp) / p) for p in args.precisions}
    base_train, base_val = results[args.precisions[0]]
    print(f"demo, {args.steps} steps, dp=2, ZeRO stage {args.zero_stage}")
    print("| precision | train loss (last 10) | vs first | val loss | vs first |")
    print("|---|---|---|---|---|")
    for precision, (train, val) in results.items():
        print(
            f"| {precision} | {train:.4f} | {train / base_train - 1:+.2%} | {val:.4f} | "
            f"{val / base_val - 1:+.2%} |"
        )


if __name__ == "__main__":
    main()
