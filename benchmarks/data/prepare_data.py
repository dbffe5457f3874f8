"""Streaming corpus preparation at scale: peak memory, throughput, start-up.

    python benchmarks/data/prepare_data.py [--big-mb 1000 --small-mb 100 --speed-mb 50 --rounds 2]

The corpus is the bundled Shakespeare (launch/assets/shakespeare.txt.gz) decompressed and
repeated to the size asked, in --folder. Every measurement runs in a fresh child process
(this script with --child), so that one run's memory never inflates another's:

- memory: the child's baseline VmRSS after its imports, its own VmHWM at the end, and the
  largest peak RSS of its worker processes (resource.getrusage(RUSAGE_CHILDREN) after the
  pool is reaped), pages shared with the parent included. Reported as an upper bound:
  main's growth above its baseline + N x the largest worker's whole peak.
- throughput: input MB per second of wall clock, launch.prepare_data with 1 and 2 workers
  against a plain `tokenizers` `encode_batch` loop over the same documents (the same
  paragraph reader, batches of 1024 documents, outputs dropped), alternated
  ref, 1, 2, ref, 1, 2, ... in the same run; ratios per round, median and range.
- start: the data phase of a training start on the prepared big corpus (prepare_data on a
  cache hit), as local rank 0 (data.verify=sample) and as another rank (no check).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def vm(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def make_corpus(folder: Path, megabytes: int) -> Path:
    path = folder / f"shakespeare-{megabytes}mb.txt"
    if path.is_file():
        return path
    from launch.data.token_file import BUNDLED_CORPUS

    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        text = f.read().rstrip("\n") + "\n\n"
    data = text.encode()
    target = megabytes * 1_000_000
    partial = path.with_suffix(".tmp")
    with open(partial, "wb") as out:
        written = 0
        while written < target:
            out.write(data)
            written += len(data)
    partial.replace(path)
    return path


def child(mode: str, corpus: Path, cache: Path, workers: int) -> dict:
    """One measurement, in this (fresh) process."""
    from launch.config import DataConfig
    from launch.data import prepare_data
    from launch.data.token_file import iter_documents
    from launch.data.tokenizers import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    baseline = vm("VmRSS")
    started = time.perf_counter()
    if mode == "reference":
        backend = tokenizer.backend_tokenizer
        batch: list[str] = []
        for text in iter_documents([corpus], "text"):
            batch.append(text)
            if len(batch) == 1024:
                backend.encode_batch(batch, add_special_tokens=False)
                batch = []
        if batch:
            backend.encode_batch(batch, add_special_tokens=False)
    elif mode in ("prepare", "start_first", "start_other"):
        config = DataConfig(files=[str(corpus)], cache_dir=str(cache), workers=workers)
        verify = "none" if mode == "start_other" else None
        data = prepare_data(config, verify)
        assert len(data.train_tokens) > 0
    elapsed = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {
        "mode": mode,
        "workers": workers,
        "seconds": elapsed,
        "mb_per_s": corpus.stat().st_size / 1e6 / elapsed,
        "baseline": baseline,
        "main_peak_above": vm("VmHWM") - baseline,
        "worker_peak": children,  # the largest reaped worker's peak RSS, shared pages included
    }


def run_child(mode: str, corpus: Path, cache: Path, workers: int = 1) -> dict:
    command = [sys.executable, __file__, "--child", mode, str(corpus), str(cache), str(workers)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def fresh_cache(folder: Path, name: str) -> Path:
    import shutil

    cache = folder / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", default="/tmp/hybrid-prepare-bench")
    parser.add_argument("--big-mb", type=int, default=1000)
    parser.add_argument("--small-mb", type=int, default=100)
    parser.add_argument("--speed-mb", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="for the memory runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "prepare_data.md"))
    parser.add_argument(
        "--speed-only", action="store_true",
        help="only the throughput rounds, written to benchmarks/data/prepare_data_speed.md",
    )  # fmt: skip
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, corpus, cache, workers = args.child
        print(json.dumps(child(mode, Path(corpus), Path(cache), int(workers))))
        return
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    speed = make_corpus(folder, args.speed_mb)
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):  # A B C A B C: the machine's load drifts
        rounds.append({
            "reference": run_child("reference", speed, folder / "unused"),
            "1 worker": run_child("prepare", speed, fresh_cache(folder, f"s1-{r}"), 1),
            "2 workers": run_child("prepare", speed, fresh_cache(folder, f"s2-{r}"), 2),
        })  # fmt: skip
    if args.speed_only:
        lines = [
            "# Corpus preparation throughput "
            "(`python benchmarks/data/prepare_data.py --speed-only`)",
            "",
            f"GPT-2 tokenizer; the bundled Shakespeare repeated; {os.cpu_count()} cores; "
            f"load average {os.getloadavg()[0]:.1f} at the end. Each figure from a fresh child "
            "process.",
            "",
            *throughput_lines(args, rounds),
        ]
        (ROOT / "benchmarks" / "data" / "prepare_data_speed.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    memory = {}
    for megabytes in (args.small_mb, args.big_mb):
        corpus = make_corpus(folder, megabytes)
        memory[megabytes] = run_child(
            "prepare", corpus, fresh_cache(folder, f"m{megabytes}"), args.workers
        )
    big = make_corpus(folder, args.big_mb)
    cache = folder / f"cache-m{args.big_mb}"
    start = {m: run_child(m, big, cache, args.workers) for m in ("start_first", "start_other")}
    write_report(args, rounds, memory, start)


def throughput_lines(args: argparse.Namespace, rounds: list) -> list[str]:
    """The throughput table: MB/s per round and each round's ratio to the reference."""
    lines = [
        f"## Throughput ({args.speed_mb} MB of text, alternated ref / 1 / 2 workers, "
        f"{args.rounds} rounds)",
        "",
        "| system | MB/s per round | ratio to reference: median (range) |",
        "|---|---|---|",
    ]
    for name in ("reference", "1 worker", "2 workers"):
        speeds = [r[name]["mb_per_s"] for r in rounds]
        ratios = [r[name]["mb_per_s"] / r["reference"]["mb_per_s"] for r in rounds]
        lines.append(
            f"| {name} | {', '.join(f'{s:.2f}' for s in speeds)} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return [
        *lines,
        "",
        "reference: `tokenizers` `Tokenizer.encode_batch` over the same paragraphs, 1024 a "
        "batch, outputs dropped (no token file written).",
    ]


def write_report(args: argparse.Namespace, rounds: list, memory: dict, start: dict) -> None:
    mib = 1 << 20
    lines = [
        "# Streaming corpus preparation (`python benchmarks/data/prepare_data.py`)",
        "",
        f"GPT-2 tokenizer; the bundled Shakespeare repeated; {os.cpu_count()} cores (shared "
        "machine, other jobs running). Each figure from a fresh child process.",
        "",
        *throughput_lines(args, rounds),
        "",
        f"## Peak memory above the baseline ({args.workers} workers)",
        "",
        "| corpus | main process, above baseline | largest worker, whole peak RSS "
        "| bound: main + N x worker | wall | MB/s |",
        "|---|---|---|---|---|---|",
    ]
    totals = {}
    for megabytes, m in memory.items():
        total = m["main_peak_above"] + args.workers * m["worker_peak"]
        totals[megabytes] = total
        lines.append(
            f"| {megabytes} MB | {m['main_peak_above'] / mib:.0f} MiB | "
            f"{m['worker_peak'] / mib:.0f} MiB | {total / mib:.0f} MiB | "
            f"{m['seconds']:.0f} s | {m['mb_per_s']:.2f} |"
        )
    small, big = totals[args.small_mb], totals[args.big_mb]
    lines += [
        "",
        f"{args.big_mb} MB against {args.small_mb} MB: {big / max(small, 1):.2f}x "
        "(target: under 1 GiB, within 1.2x).",
        "",
        "Instrument: VmRSS after imports (baseline) and VmHWM at the end from /proc/self/status;"
        " workers: getrusage(RUSAGE_CHILDREN).ru_maxrss after the pool is reaped (the whole "
        "peak, pages shared with the parent included: an upper bound).",
        "",
        f"## Start of training on the prepared {args.big_mb} MB corpus",
        "",
        "| rank | check | data phase |",
        "|---|---|---|",
        f"| local rank 0 | size + sampled hash | {start['start_first']['seconds']:.2f} s |",
        f"| other ranks | none (rank 0 checked) | {start['start_other']['seconds']:.2f} s |",
        "",
        "Data phase: `prepare_data` on a cache hit (cache key from size, mtime and a sampled "
        "hash of the input; the token file checked by size and a sampled hash), tokenizer "
        "included; target under 3 s.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
