"""Where each system's memory goes, ours next to each peer on the same model: one rank's
peak by category (parameters, gradients, optimizer, activations, temporaries, other) and
by phase (forward, backward, step) from torch's MemTracker, beside the peak RSS above the
process's baseline, in one table.

    python benchmarks/memory_breakdown.py                 # the 57M model, every pair
    python benchmarks/memory_breakdown.py --width 124m    # a gpt2-124m-shaped model
    python benchmarks/memory_breakdown.py --quick         # the small model: the harness

Each system runs as its own torchrun job (benchmarks/compare/worker.py, as in
compare_systems.py): warm-up steps, the timed steps over which the peak RSS above the
baseline is taken (metrics.PeakMeter), then one more step under MemTracker
(compare/breakdown.py), which files every storage the system's adapter names by its
role, the same rule for every system. The largest rank of each job is shown (by RSS).
Memory does not depend on the machine's load: one round is enough.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: `benchmarks.compare` imports

from benchmarks.compare.breakdown import CATEGORIES, PHASES  # noqa: E402
from benchmarks.compare.common import BenchConfig, JobSpec, machine  # noqa: E402
from benchmarks.compare.jobs import WIDTHS  # noqa: E402
from benchmarks.compare_systems import bf16_line, deepspeed_available, launch  # noqa: E402

MiB = 2**20


def pairs(bench: BenchConfig, deepspeed: bool) -> list[tuple[JobSpec, JobSpec]]:
    """(ours, peer) on the same layout: the comparisons of benchmarks/results.md."""

    def job(system: str, dp: int = 1, tp: int = 1, stage: int = 0) -> JobSpec:
        return JobSpec(system, dp, tp, stage, False, bench)

    out = [
        (job("ours"), job("plain")),
        (job("ours", dp=2), job("ddp", dp=2)),
        (job("ours", dp=2, stage=3), job("fsdp2", dp=2, stage=3)),
        (job("ours", tp=2), job("dtensor_tp", tp=2)),
        (job("ours", dp=2, tp=2, stage=3), job("fsdp2_tp", dp=2, tp=2, stage=3)),
    ]
    if deepspeed:
        out += [(job("ours", dp=2, stage=s), job("deepspeed", dp=2, stage=s)) for s in range(4)]
    return out


def largest_rank(ranks: list[dict]) -> dict:
    return max(ranks, key=lambda r: r["peak"]["peak_above_baseline"])


def rows_of(spec: JobSpec, ranks: list[dict] | str) -> list[str]:
    """The system's table rows: its overall peak, then each phase's."""
    if isinstance(ranks, str):
        return [f"| {spec.label} | {ranks} |" + " |" * (len(CATEGORIES) + 2)]
    rank = largest_rank(ranks)
    rss = rank["peak"]["peak_above_baseline"] / MiB
    tracked = rank["breakdown"]
    out = []
    for name in ("peak", *PHASES):
        snap = tracked["peak"] if name == "peak" else tracked["phases"].get(name)
        if snap is None:
            continue
        label = spec.label if name == "peak" else f"&nbsp;&nbsp;{name}"
        where = f" ({snap['phase']})" if name == "peak" else ""
        cells = " | ".join(f"{snap[c] / MiB:.1f}" for c in CATEGORIES)
        phase_rss = rank.get("rss_phases", {}).get(name)
        first = f"{rss:.1f}" if name == "peak" else (f"{phase_rss / MiB:.1f}" if phase_rss else "")
        out.append(f"| {label}{where} | {first} | {snap['total'] / MiB:.1f} | {cells} |")
    return out


def ratio_line(ours: list[dict] | str, peer: list[dict] | str, peer_spec: JobSpec) -> str:
    if isinstance(ours, str) or isinstance(peer, str):
        return f"- ours / {peer_spec.label}: not measured (a job failed)"
    a, b = largest_rank(ours), largest_rank(peer)
    rss = a["peak"]["peak_above_baseline"] / b["peak"]["peak_above_baseline"]
    tracked = a["breakdown"]["peak"]["total"] / b["breakdown"]["peak"]["total"]
    return (
        f"- ours / {peer_spec.label}: peak RSS above baseline **{rss:.3f}x**, MemTracker "
        f"peak {tracked:.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", choices=sorted(WIDTHS), default="57m")
    parser.add_argument("--quick", action="store_true", help="the small model (3.3M)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's pairs")
    parser.add_argument(
        "--pairs", type=int, nargs="+", help="only these pairs, by their order here (0 first)"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter of the jobs")
    parser.add_argument("--out", type=Path, help="default benchmarks/memory_breakdown[_W].md")
    parser.add_argument("--raw-dir", type=Path, help="keep each job's JSON and log here")
    args = parser.parse_args()

    bench = BenchConfig.quick() if args.quick else BenchConfig(**WIDTHS[args.width])
    deepspeed, detail = (
        (False, "--no-deepspeed") if args.no_deepspeed else (deepspeed_available(args.python))
    )
    raw = args.raw_dir or Path(tempfile.mkdtemp(prefix="memory_breakdown-"))
    started = time.time()
    header = ["system (phase of the peak)", "peak RSS above baseline", "MemTracker total"]
    text_pairs = []
    for n, (ours, peer) in enumerate(pairs(bench, deepspeed)):
        if args.pairs is not None and n not in args.pairs:
            continue
        results = []
        for k, spec in enumerate((ours, peer)):
            folder = raw / f"pair{n}" / f"job{k}"
            result = launch(spec, args.python, folder, 900.0, "cpu", breakdown=True)
            results.append(result)
            print(f"{spec.label}: {'done' if not isinstance(result, str) else result}", flush=True)
        text_pairs += [
            f"### {ours.layout}, stage {ours.stage}: ours and {peer.label}",
            "",
            "| " + " | ".join([*header, *CATEGORIES]) + " |",
            "|" + "---|" * (len(header) + len(CATEGORIES)),
            *rows_of(ours, results[0]),
            *rows_of(peer, results[1]),
            "",
            ratio_line(results[0], results[1], peer),
            "",
        ]
    info = machine()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    text = [
        "# Memory by category and phase, ours next to each peer",
        "",
        f"Command: `{command}` ({(time.time() - started) / 60:.1f} min). Machine: "
        f"{info['cpu']}, {info['cores']} cores; torch {info['torch']}; DeepSpeed: "
        f"{detail if deepspeed else 'not run (' + detail + ')'}.",
        "",
        f"Model: GPT-2 style, {bench.parameter_count() / 1e6:.1f}M parameters "
        f"({bench.n_layer} layers, d_model {bench.d_model}, seq {bench.seq_len}, vocab "
        f"{bench.vocab_size}), fp32, global batch {bench.global_batch}, torch AdamW (fused) "
        "for every system, clipping at 1.0.",
        "",
        bf16_line(bench),
        "",
        "Per job, the rank with the largest peak RSS. **Peak RSS above baseline**: VmHWM "
        "over the timed steps minus VmRSS after imports and process-group start "
        "(benchmarks/compare/metrics.PeakMeter), everything the process holds, C++-held "
        "buffers included. **MemTracker**: one more step under torch's MemTracker; the row "
        "of the system is its peak, with the phase it falls in; the rows below it are each "
        "phase's own peak. Categories (MiB; compare/breakdown.py): a storage the system's "
        "adapter names is filed by its role, the rest by when MemTracker saw it made "
        "(activations in forward, temporaries in backward and the step); `other` is module "
        "buffers and named communication buffers.",
        "",
        *text_pairs,
    ]
    name = (
        "memory_breakdown"
        + ("_quick" if args.quick else "")
        + ("" if args.width == "57m" or args.quick else f"_{args.width}")
    )
    out = args.out or HERE / f"{name}.md"
    out.write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
