"""Peak memory of whole `launch.pretrain` runs per ZeRO stage, measured from outside,
against the planner.

    python benchmarks/run_memory.py [--stages 0 1 2 3] [--steps 3] [--out benchmarks/run_memory.md]

Each run is a real `torchrun --standalone --nproc_per_node 2 -m launch.pretrain` job (dp=2,
fp32) of a 12-layer, d_model 768 GPT on the bundled corpus: start-up, training steps,
evaluation, a checkpoint, the sample and the final weights. The instrument is the kernel's:
a small wrapper process starts torchrun and, once it has returned, reads
`getrusage(RUSAGE_CHILDREN).ru_maxrss`, the peak resident set of the largest process below
it (a rank: torchrun's own agent is smaller). From that the same job with a tiny model (1
layer, d_model 64) at the same stage is subtracted: the interpreter, torch, the tokenizer,
the data and gloo, which do not depend on the model. What is left is what the model costs
the largest rank, for the whole run; the planner (`python -m launch.plan ... --json`)
predicts it for the layout as the peak of a training step. Nothing here asks the engine.

Ranks also log their own peak (`peak_mem_bytes` in metrics.jsonl); it is shown beside, as
a cross-check, not as the measurement.
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
LARGE = ["model.n_layer=12", "model.n_head=12", "model.d_model=768"]
TINY = ["model.n_layer=1", "model.n_head=4", "model.d_model=64"]
COMMON = [
    "model.seq_len=128",
    "model.dropout=0.0",
    "parallel.tp=1",
    "train.precision=fp32",
    "train.global_batch_size=8",  # 2 micro-batches a rank: stage 1 keeps full gradients
    "train.micro_batch_size=2",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "checkpoint.every=0",
    "sample.tokens=8",
    "tracking.wandb.mode=disabled",
]
# Runs the command and prints the peak RSS (bytes) of its largest descendant: ru_maxrss of
# RUSAGE_CHILDREN covers every descendant waited for (Linux reports KiB).
WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code)\n"
)
VOCAB = 512  # the demo's BPE of 512 tokens, already a multiple of 128


def run_job(model: list[str], stage: int, steps: int, work: Path, cache: Path) -> dict:
    """One whole pretraining job; its largest process's peak RSS and its metrics."""
    run_dir = work / f"run-{len(list(work.iterdir()))}"
    overrides = [
        *COMMON,
        *model,
        f"parallel.zero_stage={stage}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", "-m", "launch.pretrain"]
    command += ["--config", str(ROOT / "configs" / "tiny.yaml"), *overrides]
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", WRAPPER, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    peak, code = (int(x) for x in out.stdout.split()[-2:])
    if code != 0:
        raise RuntimeError(f"stage {stage} {model}: exit {code}\n{out.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = max((m.get("peak_mem_bytes", 0) for m in metrics), default=0)
    return {"peak_rss": peak, "logged_peak": logged, "seconds": time.perf_counter() - started}


def planned_peak(stage: int) -> dict:
    """The planner's peak of a step for the large model on this layout, on gloo (`peak`,
    without the reserve `total` adds for CUDA's context and NCCL)."""
    command = [sys.executable, "-m", "launch.plan", "--config", str(ROOT / "configs" / "tiny.yaml")]
    command += [*COMMON, *LARGE, "--gpus", "2", "--zero-stage", str(stage)]
    command += ["--vocab", str(VOCAB), "--backend", "gloo", "--json"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "run_memory.md")
    p.add_argument("--raw", type=Path, default=ROOT / "benchmarks" / "raw" / "run_memory.json")
    p.add_argument(
        "--report-only", action="store_true", help="re-plan and rewrite --out from --raw"
    )
    args = p.parse_args()
    if args.report_only:
        rows = json.loads(args.raw.read_text())
        for row in rows:
            row["plan"] = planned_peak(row["stage"])
        args.out.write_text(report(rows, args))
        print(args.out.read_text())
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp) / "runs", Path(tmp) / "cache"
        work.mkdir()
        run_job(TINY, 0, 1, work, cache)  # fills the tokenizer and token caches, unmeasured
        for stage in args.stages:
            base = run_job(TINY, stage, args.steps, work, cache)
            large = run_job(LARGE, stage, args.steps, work, cache)
            plan = planned_peak(stage)
            measured = large["peak_rss"] - base["peak_rss"]
            row = {"stage": stage, "measured": measured, "plan": plan, "base": base, "large": large}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.raw.write_text(json.dumps(rows, indent=1))
    args.out.write_text(report(rows, args))
    print(args.out.read_text())


def predicted(plan: dict) -> int:
    return int(plan["memory"]["peak"])


def report(rows: list[dict], args: argparse.Namespace) -> str:
    gib = 2**30
    lines = [
        "# Whole-run peak memory per rank against the planner",
        "",
        f"`python benchmarks/run_memory.py --steps {args.steps}`: `launch.pretrain` at dp=2, "
        "fp32, a 12-layer d_model 768 GPT (vocabulary 512, sequence 128, micro-batch 2, "
        "global batch 8: two micro-batches a rank), with evaluation, a checkpoint, a "
        "sample and the final weights. "
        "Measured: peak RSS of the largest rank (the kernel's `ru_maxrss`) less that of the "
        "same job with a 1-layer d_model 64 model. Planned: the planner's peak of a step.",
        "",
        "| stage | measured (GiB) | planned (GiB) | measured / planned | logged by the ranks "
        "(GiB) | baseline RSS (GiB) | run time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        plan = predicted(row["plan"])
        lines.append(
            f"| {row['stage']} | {row['measured'] / gib:.3f} | {plan / gib:.3f} | "
            f"{row['measured'] / plan:.3f} | {row['large']['logged_peak'] / gib:.3f} | "
            f"{row['base']['peak_rss'] / gib:.3f} | {row['large']['seconds']:.0f} |"
        )
    by_stage = {row["stage"]: row["measured"] for row in rows}
    if set(by_stage) >= {0, 1, 2, 3}:
        order = by_stage[3] < by_stage[2] <= by_stage[1] < by_stage[0]
        lines += ["", f"Paper order 3 < 2 <= 1 < 0: {'holds' if order else 'FAILS'}."]
    worst = max(abs(row["measured"] / predicted(row["plan"]) - 1) for row in rows)
    lines += [f"Largest deviation from the planner: {worst:.1%} (target: within 15%).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
