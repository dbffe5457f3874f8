"""Prepare a pretraining config's corpus into the token cache, before training:

    python -m launch.prepare_data --config configs/tiny.yaml [key=value ...] [--workers N]

It tokenizes `data.files` (and each source of `data.mixture`) with N processes (default
`data.workers`, 0: one per core), streaming (memory does not grow with the corpus), with a
progress bar, into the cache folder `launch.pretrain` reads (the same key). Run again
after a crash, it keeps the input files already finished. `launch.pretrain` runs the same
preparation when the cache is missing, on one rank per node.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from launch.config import Config, ConfigError, DataConfig, load_config
from launch.data import prepare_data
from launch.data.mixture import shared_tokenizer
from launch.data.prepare.read import total_bytes
from launch.data.token_file import resolve_files


def sources(config: Config) -> list[DataConfig]:
    """The data configs to prepare: each mixture source (its files in place of
    data.files, with the tokenizer training uses for all of them), else data.files."""
    data = config.data
    if not data.mixture:
        return [data]
    data = shared_tokenizer(data)  # bpe: one vocabulary trained on every source, as training
    return [dataclasses.replace(data, files=list(s.files), mixture=[]) for s in data.mixture]


def prepare(config: Config, progress: bool | None = None) -> list[str]:
    """Prepare every source of `config`; one line of summary per source."""
    lines = []
    for data in sources(config):
        paths = resolve_files(data.files)
        started = time.perf_counter()
        prepared = prepare_data(data, progress=progress)
        elapsed = time.perf_counter() - started
        n_tokens = len(prepared.train_tokens) + len(prepared.val_tokens)
        megabytes = total_bytes(paths) / 1e6
        lines.append(
            f"{', '.join(map(str, paths))}: {n_tokens:,} tokens, {megabytes:,.1f} MB in "
            f"{elapsed:.1f}s ({megabytes / max(elapsed, 1e-9):,.1f} MB/s; a cached corpus "
            "is only checked)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.prepare_data",
        description="Tokenize a pretraining config's corpus into the token cache.",
    )
    parser.add_argument("--config", help="YAML file, e.g. configs/tiny.yaml")
    parser.add_argument("--workers", type=int, help="tokenizing processes (default data.workers)")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. data.files=[a.txt]")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.workers is not None:
        if args.workers < 0:
            print(
                f"error: --workers {args.workers}: give 0 (one per core) or more", file=sys.stderr
            )
            return 2
        overrides.append(f"data.workers={args.workers}")
    try:
        config = load_config(args.config, overrides)
        for line in prepare(config):
            print(line, flush=True)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        # one line: a library's multi-line message would read as a crash
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
