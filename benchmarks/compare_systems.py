"""Our engine side by side with DeepSpeed, PyTorch (DDP, FSDP2, DTensor TP, FSDP2 + TP)
and a plain single-process loop: same GPT, same initial weights, same data, same global
batch (fp32 on CPU).

    python benchmarks/compare_systems.py --rounds 3 --steps 20

Every (system, configuration) runs as its own `torchrun --standalone` job
(benchmarks/compare/worker.py). Competing configurations run next to each other and the
whole order is reversed every other round (A B C .. C B A ..), and the table reports
medians over rounds, since this machine is shared and noisy. Writes benchmarks/results.md
(table, acceptance checks, machine, versions, command), benchmarks/results.png and the raw
numbers in benchmarks/results.json. DeepSpeed runs when the interpreter that runs the jobs
can import it, else it is skipped with the reason. Install it apart from the dev venv, with
the CPU torch first and no build isolation (which would fetch a CUDA torch to build with):

    python3 -m venv /tmp/venv-bench && . /tmp/venv-bench/bin/activate
    pip install torch==2.13.0 && pip install --no-build-isolation -e ".[bench]"

On CPU it runs over gloo with no further setup: it builds a small shared-memory op on its
first use (cached under ~/.cache/torch_extensions), outside the timed steps.

On a machine with CUDA it then runs the GPU section (benchmarks/compare/gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: `benchmarks.compare` imports

from benchmarks.compare import gpu  # noqa: E402
from benchmarks.compare.common import SYSTEMS, BenchConfig, JobSpec, machine  # noqa: E402
from benchmarks.compare.report import Row, acceptance, chart, table  # noqa: E402


def plan(bench: BenchConfig, recompute: list[bool], systems: set[str]) -> list[JobSpec]:
    """The configurations, competitors next to each other: ours first in each group."""
    specs = []
    for rc in recompute:

        def job(system: str, dp: int = 1, tp: int = 1, stage: int = 0, rc: bool = rc) -> JobSpec:
            return JobSpec(system, dp, tp, stage, rc, bench)

        specs += [job("ours"), job("plain")]
        for stage in range(4):
            specs += [job("ours", dp=2, stage=stage), job("deepspeed", dp=2, stage=stage)]
            specs += [job("ddp", dp=2), job("floor", dp=2)] if stage == 0 else []
            specs += [job("fsdp2", dp=2, stage=3)] if stage == 3 else []
        specs += [job("ours", tp=2), job("dtensor_tp", tp=2)]
        specs += [job("ours", dp=2, tp=2, stage=3), job("fsdp2_tp", dp=2, tp=2, stage=3)]
    return [s for s in specs if s.system in systems]


def deepspeed_available(python: str) -> tuple[bool, str]:
    probe = subprocess.run(
        [python, "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    if probe.returncode == 0:
        return True, probe.stdout.strip().splitlines()[-1]
    error = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
    return False, f"`import deepspeed` failed under {python}: {error}"


def launch(spec: JobSpec, python: str, out: Path, timeout_s: float, device: str) -> Row | str:
    """Run one job; its rank JSONs, or the reason it failed (the log's last lines)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(spec.world),
        "-m",
        "benchmarks.compare.worker",
        "--spec",
        spec.to_json(),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU would switch init_distributed to nccl
    log = out / "job.log"
    with open(log, "w") as f:
        try:
            done = subprocess.run(
                command,
                cwd=HERE.parent,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = -1
    ranks = sorted(out.glob("rank*.json"))
    if code == 0 and len(ranks) == spec.world:
        return [json.loads(p.read_text()) for p in ranks]
    lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
    # The first exception a rank raised says why; torchrun's own summary does not.
    errors = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)]
    reason = "timed out" if code == -1 else f"exit {code}"
    detail = errors[0] if errors else " / ".join(lines[-3:])
    return f"failed ({reason}): {detail[-300:]}".replace("|", "/")


def _without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument(
        "--recompute", nargs="+", default=["none", "full"], choices=["none", "full"]
    )
    parser.add_argument("--layers", type=int, default=BenchConfig.n_layer)
    parser.add_argument("--heads", type=int, default=BenchConfig.n_head)
    parser.add_argument("--d-model", type=int, default=BenchConfig.d_model)
    parser.add_argument("--seq-len", type=int, default=BenchConfig.seq_len)
    parser.add_argument("--global-batch", type=int, default=BenchConfig.global_batch)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: one GPU per rank, bf16 (untested here: no GPU was at hand)",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter of the jobs")
    parser.add_argument("--job-timeout", type=float, default=900.0)
    parser.add_argument("--raw-dir", type=Path, help="keep each job's JSON and log here")
    parser.add_argument("--out", type=Path, default=HERE / "results.md")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    gpu.add_arguments(parser)
    args = parser.parse_args()

    bench = BenchConfig(
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
    )
    skipped: dict[str, str] = {}
    systems = set(args.systems)
    if "deepspeed" in systems:
        ok, detail = deepspeed_available(args.python)
        if not ok:
            systems.discard("deepspeed")
            skipped["deepspeed"] = detail
        deepspeed_version = detail if ok else "not installed"
    else:
        deepspeed_version = "not run"
    specs = plan(bench, [r == "full" for r in args.recompute], systems)
    rows = {spec: Row(spec) for spec in specs}
    raw = args.raw_dir or Path(tempfile.mkdtemp(prefix="compare_systems-"))
    print(f"{len(specs)} configurations x {args.rounds} rounds; job logs under {raw}", flush=True)
    started = time.time()
    for round_index in range(args.rounds):
        order = specs if round_index % 2 == 0 else specs[::-1]
        for n, spec in enumerate(order):
            row = rows[spec]
            if row.failure:
                continue  # a configuration that failed once is not retried
            folder = raw / f"round{round_index}" / f"job{specs.index(spec):02d}"
            result = launch(spec, args.python, folder, args.job_timeout, args.device)
            if isinstance(result, str):
                row.failure = result
                status = result
            else:
                row.rounds.append(result)
                status = f"{max(r['median_time'] for r in result) * 1e3:.1f} ms"
            print(
                f"[round {round_index + 1}/{args.rounds} job {n + 1}/{len(order)}] "
                f"{spec.label}: {status}",
                flush=True,
            )
    elapsed = time.time() - started

    gpu_lines = gpu.section(args) if not args.no_gpu else ["Skipped (--no-gpu)."]
    ordered = [rows[s] for s in specs]
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    smoke = args.rounds < 3 or args.steps < 20
    info = machine()
    text = [
        "# Systems side by side" + (" (SMOKE RUN: too few rounds/steps to rank)" if smoke else ""),
        "",
        *(
            [
                "A smoke run checks the harness end to end: with one job per configuration and "
                "a few steps, on a machine other work shares, step times and their ratios (and "
                "so the time verdicts below) are not evidence. Losses, model-state bytes and "
                "communication do not depend on the load. Rank with the default "
                "`--rounds 3 --steps 20` on a quiet machine.",
                "",
            ]
            if smoke
            else []
        ),
        f"Command: `{command}` ({elapsed / 60:.1f} min).",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gb']} GB; "
        f"{info['platform']}. Python {info['python']}, torch {info['torch']}, "
        f"DeepSpeed {deepspeed_version}.",
        "",
        f"Model: GPT-2 style, {bench.n_layer} layers, {bench.n_head} heads, d_model "
        f"{bench.d_model}, seq {bench.seq_len}, vocab {bench.vocab_size} (bytes of the "
        f"bundled Shakespeare), tied embeddings, dropout 0, "
        f"{'bf16' if bench.bf16 else 'fp32'}. Global batch "
        f"{bench.global_batch} sequences = {bench.tokens_per_step} tokens per step, split "
        f"over DP. AdamW (torch's, fused, lr {bench.lr}, betas {bench.betas}, weight decay "
        f"{bench.weight_decay} on matrices), clipping at {bench.grad_clip}. "
        f"{args.rounds} round(s), each job {bench.warmup} untimed + {bench.steps} timed "
        "steps, one thread per rank.",
        "",
        "Columns: step time is the median over rounds of the slowest rank's median step; "
        "tokens/s is the global batch's tokens over it. Peak RSS is the largest rank's "
        "high-water mark. Model states are all floating-point tensor storages alive in Python at "
        "the end of backward (parameters, gradients and gradient buckets, master copies, optimizer "
        "moments), each once (the least of 4 samples 20 ms apart, against transients). "
        "Communication is counted at torch's "
        "dispatcher (c10d and functional collectives) for every system (all-reduce and "
        "broadcast: the tensor; all-gather: the gathered output; "
        "reduce-scatter: the full input). Loss differences are relative to the plain loop, "
        "at every step. `ours / best peer` compares step times within the same layout, "
        "stage and recompute setting.",
        "",
        *table(ordered),
        "",
        "## Acceptance (issue #7)",
        "",
        *acceptance(ordered),
        "",
    ]
    if skipped:
        text += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    text += ["## GPU", "", *gpu_lines, ""]
    args.out.write_text("\n".join(text))
    title = f"{bench.n_layer}-layer GPT, d_model {bench.d_model}" + (
        " (smoke run)" if smoke else ""
    )
    chart(ordered, args.out.with_suffix(".png"), title)
    dump = {
        "command": command,
        "machine": info,
        "skipped": skipped,
        "rows": [
            {
                "spec": json.loads(r.spec.to_json()),
                "failure": r.failure,
                "rounds": [[_without(rank, "machine") for rank in ranks] for ranks in r.rounds],
            }
            for r in ordered
        ],
    }
    args.out.with_suffix(".json").write_text(json.dumps(dump))
    print("\n".join(text))


if __name__ == "__main__":
    main()
