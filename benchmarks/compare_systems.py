"""Our engine side by side with DeepSpeed, PyTorch (DDP, FSDP2, DTensor TP, FSDP2 + TP)
and a plain single-process loop: same GPT, same initial weights, same data, same global
batch (fp32 on CPU).

    python benchmarks/compare_systems.py           # the default: 57M parameters, 4 rounds
    python benchmarks/compare_systems.py --quick   # the small model: checks the harness

Every (system, configuration) runs as its own `torchrun --standalone` job
(benchmarks/compare/worker.py). Each round runs every job once; competing configurations
run next to each other and the order is reversed every other round (A B C .. / .. C B A),
so over an even number of rounds every pair runs in each order equally often. Measured
the same way for every system, never from a system's own accounting (common.py and
metrics.py say how):
- time: per job the slowest rank's median step; ours against a peer is the median over
  rounds of the ratio within each round, with the least and largest of those ratios;
- memory: the peak during the timed steps above each process's own baseline (read after
  imports and process-group start, before the model is built; the high-water mark is
  reset just before the timed steps), the largest rank; and the model states
  (parameters, gradients, optimizer states) measured as tensor storages, with DeepSpeed's
  preallocated reduce buckets and any other live tensor counted apart.
Writes benchmarks/results.md (table, checks, what is measured, machine, versions,
command), benchmarks/raw/results.png and the raw numbers in benchmarks/raw/results.json.

The default model (8 layers x d_model 768, 57M parameters, 4 x 128 tokens per step) is
sized so that its parameters dominate memory (fp32 model states 0.9 GB per rank at stage
0, against an import baseline of 0.2-0.3 GB and 0.1-0.2 GB of activations) and one run
fits in about an hour on 2 CPU cores: 17 configurations x 4 rounds, each job 2 warm-up +
4 timed steps. Measured here (a shared machine, 5x loaded: the small model's dp=2 step
took 1.7 s against 0.33 s quiet): a default-model step took 3-4 s in one process and 4-5 s
at dp=2, a job 60-90 s; scaled to a quiet machine a step is about 0.6-1 s at dp=2 and a job
about 30 s, so 68 jobs take about 35-45 min. `--recompute none full` doubles it. `--quick`
(4 layers x 256, 3.3M parameters) with `--rounds 2 --steps 3` takes about 15 min quiet.

DeepSpeed runs when the interpreter that runs the jobs can import it, else it is skipped
with the reason. Install it apart from the dev venv, with the CPU torch first and no build
isolation (which would fetch a CUDA torch to build with):

    python3 -m venv /tmp/venv-bench && . /tmp/venv-bench/bin/activate
    pip install torch==2.13.0 && pip install --no-build-isolation -e ".[bench]"

On CPU it runs over gloo with no further setup: it builds a small shared-memory op on its
first use (cached under ~/.cache/torch_extensions), outside the timed steps.

On a machine with CUDA it then runs the GPU section (benchmarks/compare/gpu.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: `benchmarks.compare` imports

from benchmarks.compare import gpu  # noqa: E402
from benchmarks.compare.common import SYSTEMS, BenchConfig, machine  # noqa: E402
from benchmarks.compare.jobs import deepspeed_available, launch, plan, round_order  # noqa: E402
from benchmarks.compare.report import MB, Row, chart, checks, table  # noqa: E402
from launch.observe.matmul_rate import native_bf16  # noqa: E402


def _without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The default model, or the small one under --quick; shape flags override either."""
    base = BenchConfig.quick() if args.quick else BenchConfig()
    shape = {
        "n_layer": args.layers,
        "n_head": args.heads,
        "d_model": args.d_model,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    given = {k: v for k, v in shape.items() if v is not None}
    return replace(base, device=args.device, precision=precision, **given)


def bf16_line(bench: BenchConfig) -> str:
    """Why this table is or is not in bf16 on this CPU (a timed GEMM says, not the name)."""
    if bench.device != "cpu":
        return f"Precision: {bench.precision} on {bench.device}."
    native, detail = native_bf16()
    if bench.bf16:
        return f"Precision: bf16 ({detail})."
    verdict = (
        "the bf16 pairs run with `--precision bf16` (into results_bf16.md)"
        if native
        else "the bf16 pairs are absent: their times would measure torch's emulated "
        "bf16 kernels, not the systems"
    )
    return f"Precision: fp32. {detail}: {verdict}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the small model (4 layers x 256, 3.3M parameters): checks the harness in "
        "minutes; its memory figures are not parameter-dominated",
    )
    parser.add_argument("--rounds", type=int, default=4, help="even, or 1 (default 4)")
    parser.add_argument("--steps", type=int, help="timed steps per job (default 4; quick 5)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (>= 2; default 2)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument(
        "--recompute",
        nargs="+",
        default=["none"],
        choices=["none", "full"],
        help="`none full` runs every configuration with and without (twice the time)",
    )
    parser.add_argument("--layers", type=int, help="default 8 (quick 4)")
    parser.add_argument("--heads", type=int, help="default 12 (quick 4)")
    parser.add_argument("--d-model", type=int, help="default 768 (quick 256)")
    parser.add_argument("--seq-len", type=int, help="default 128 (quick 256)")
    parser.add_argument("--global-batch", type=int, help="default 4 (quick 8)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: one GPU per rank, bf16 (untested here: no GPU was at hand)",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        help="default fp32 on CPU, bf16 on CUDA; bf16 on CPU only with native bf16 kernels "
        "(a timed matmul decides) and --out defaults to results_bf16.md",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter of the jobs")
    parser.add_argument("--job-timeout", type=float, default=900.0)
    parser.add_argument("--raw-dir", type=Path, help="keep each job's JSON and log here")
    parser.add_argument("--out", type=Path, help="default benchmarks/results.md")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    gpu.add_arguments(parser)
    args = parser.parse_args()
    if args.rounds > 1 and args.rounds % 2:
        parser.error("--rounds must be even (or 1): each pair then runs in each order equally")

    bench = bench_config(args)
    if bench.device == "cpu" and bench.bf16:
        native, detail = native_bf16()
        if not native:
            parser.error(f"{detail}: bf16 times would measure the emulation; use fp32")
    args.out = args.out or HERE / (
        "results_bf16.md" if bench.bf16 and bench.device == "cpu" else "results.md"
    )
    precision_line = bf16_line(bench)
    print(precision_line, flush=True)
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
        order = round_order(specs, round_index)
        for n, spec in enumerate(order):
            row = rows[spec]
            if row.failure:
                continue  # a configuration that failed once is not retried
            folder = raw / f"round{round_index}" / f"job{specs.index(spec):02d}"
            job_started = time.time()
            result = launch(spec, args.python, folder, args.job_timeout, args.device)
            job_s = time.time() - job_started
            if isinstance(result, str):
                row.failure = result
                status = result
            else:
                row.rounds.append(result)
                status = (
                    f"{max(r['median_time'] for r in result) * 1e3:.1f} ms, peak above "
                    f"baseline {max(r['peak']['peak_above_baseline'] for r in result) / MB:.0f} MB"
                )
            print(
                f"[round {round_index + 1}/{args.rounds} job {n + 1}/{len(order)}] "
                f"{spec.label}: {status} (job {job_s:.0f} s)",
                flush=True,
            )
    elapsed = time.time() - started

    gpu_lines = gpu.section(args) if not args.no_gpu else ["Skipped (--no-gpu)."]
    ordered = [rows[s] for s in specs]
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    smoke = args.quick or args.rounds < 2 or bench.steps < 3
    info = machine()
    params = bench.parameter_count()
    first = -(-args.rounds // 2)
    text = [
        "# Systems side by side"
        + (" (QUICK: the small model)" if args.quick else "")
        + (" (SMOKE RUN: too few rounds/steps to rank)" if smoke and not args.quick else ""),
        "",
        *(
            [
                "A quick or smoke run checks the harness end to end. With the small model the "
                "import baselines and fixed costs swamp the memory and time figures, and with "
                "few rounds and steps on a machine other work shares, step times and their "
                "ratios (and so the time verdicts below) are not evidence. Losses, model-state "
                "bytes and communication do not depend on the load. Rank with the default "
                "model and rounds on a quiet machine.",
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
        precision_line,
        "",
        f"Model: GPT-2 style, {params / 1e6:.1f}M parameters: {bench.n_layer} layers, "
        f"{bench.n_head} heads, d_model {bench.d_model}, seq {bench.seq_len}, vocab "
        f"{bench.vocab_size} (bytes of the bundled Shakespeare), tied embeddings, dropout 0, "
        f"{'bf16' if bench.bf16 else 'fp32'}. Global batch "
        f"{bench.global_batch} sequences = {bench.tokens_per_step} tokens per step, split "
        f"over DP. AdamW (torch's, fused, lr {bench.lr}, betas {bench.betas}, weight decay "
        f"{bench.weight_decay} on matrices), clipping at {bench.grad_clip}. "
        f"{args.rounds} round(s), each job {bench.warmup} untimed + {bench.steps} timed "
        "steps, one thread per rank. Each round runs every job once, the order reversed "
        f"every other round: each pair of jobs ran in one order in {first} round(s) and in "
        f"the other in {args.rounds - first}.",
        "",
        "What is measured, and how (the same instrument for every system; no system's own "
        "accounting is used):",
        "",
        "- **Step time**: per job, the slowest rank's median over the timed steps; the table "
        "shows its median over rounds. `ours / fastest peer` (and every time check) is the "
        "median over rounds of the ratio of the two jobs' step times in the same round, "
        "with the least and largest of those ratios in brackets.",
        "- **Peak above baseline**: per rank, the most the process held during the timed "
        "steps minus what it held after its imports and process-group start, before the "
        "model was built: "
        + (
            "torch.cuda.max_memory_allocated over the timed steps (reset just before them) "
            "minus memory_allocated at the baseline"
            if bench.device == "cuda"
            else "VmHWM after the timed steps (reset to VmRSS just before them, by writing 5 to "
            "/proc/self/clear_refs) minus VmRSS at the baseline, less the growth of file-backed "
            "pages (RssFile: library code the first steps page in, flat over the timed steps); "
            "baseline and reset follow a garbage collection and malloc_trim, so pages malloc "
            "kept of earlier frees are not counted"
        )
        + ". The largest rank, median over rounds. It includes everything the system holds "
        "(model states, communication buffers, activations, transients, C++-held tensors "
        "such as DDP's buckets) and nothing of the interpreter, torch or the system's import.",
        "- **Model states**: the storages of parameters, gradients and optimizer states "
        "(Adam moments, master copies) alive at the end of the last warm-up step's backward, "
        "each storage once, found by walking Python's objects and sized here (where a system "
        "keeps gradient partitions or masters outside `.grad` and torch's optimizer, the "
        "benchmark's adapter names the attributes: ours' flat shards, DeepSpeed's "
        "partitions). **Preallocated comm buffers** (DeepSpeed's reduce buckets, "
        f"`reduce_bucket_size` = {bench.bucket_elements():,} elements, our bucket size) and "
        "**other tensors** (e.g. gradient buckets; tensors only C++ holds are not seen) are "
        "counted apart, never as model states.",
        "- **Communication**: counted at torch's dispatcher (c10d and functional "
        "collectives) for every system during the last warm-up step (all-reduce and "
        "broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the full "
        "input).",
        "- **Losses**: relative to the plain loop, at every step.",
        "",
        *table(ordered),
        "",
        "## Checks",
        "",
        "Targets: the time ratios are issue #7's; the memory ones ask ours to hold no more "
        "than the peer, and the stage order is ZeRO's. A row whose memory cannot be right "
        "(peak not reset, or below the model states it holds) fails the first check and "
        "suppresses the peak comparisons.",
        "",
        *checks(ordered),
        "",
    ]
    if skipped:
        text += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    text += ["## GPU", "", *gpu_lines, ""]
    args.out.write_text("\n".join(text))
    title = f"{bench.n_layer}-layer GPT, d_model {bench.d_model}" + (
        " (smoke run)" if smoke else ""
    )
    (args.out.parent / "raw").mkdir(exist_ok=True)
    chart(ordered, args.out.parent / "raw" / f"{args.out.stem}.png", title)
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
    (args.out.parent / "raw" / f"{args.out.stem}.json").write_text(json.dumps(dump))
    print("\n".join(text))


if __name__ == "__main__":
    main()
