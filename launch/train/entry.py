"""The command line shared by launch.pretrain and launch.finetune: read and check the
config before any process group exists, then run the job.

Every error found before start-up is one line on stderr and exit code 2, on every rank
alike, so a bad config never leaves a half-started job behind.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from launch.config import Config, ConfigError, validate_layout
from launch.data.hf_folders import check_hf_folders
from launch.data.mixture import check_sources
from launch.data.shards import TokenShards, is_token_shards
from launch.data.token_file import resolve_files
from launch.data.tokenizers import tokenizer_size
from launch.observe.matmul_rate import slow_bf16_warning
from launch.planning.memory_check import check_memory
from launch.train.checkpointing import resume_candidate, verify_resume
from launch.train.loop import train
from launch.train.preemption import NonFiniteLoss


def parse_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. train.lr=3e-4 parallel.tp=2")
    return parser.parse_args(argv)


# Token shards up to this size have every id checked before any process group (a second
# at the scan's ~1.6 GB/s); a larger folder's first scan runs in the data phase instead.
SCAN_AT_START_BYTES = 1 << 30


def check_token_shards(folder: Path, n_tokens: int, cache_dir: Path) -> None:
    """The manifest, the shards' presence and sizes and the vocabulary, always; every id and
    hash too when that is cheap: a folder up to SCAN_AT_START_BYTES, or one whose scan
    passed before (its stamp in the cache). A bad id is then one line before any process
    group. A larger folder is scanned the first time in the data phase, by local rank 0
    of each node while the others wait on the store, since a scan of a TB takes minutes
    and a rank that late to the rendezvous would end the job."""
    shards = TokenShards(folder, n_tokens, scan=False)
    if len(shards) * shards.dtype.itemsize <= SCAN_AT_START_BYTES:
        shards.scan(cache_dir)


def check_before_start(config: Config, world_size: int) -> int:
    """Everything that can be checked without a process group; returns dp."""
    dp = validate_layout(config, world_size)
    try:
        paths = resolve_files(config.data.files)
        for path in paths:
            if path.is_file() and path.stat().st_size == 0:
                raise ValueError(f"data.files: {path} is empty; give files that hold text")
        check_sources(config.data)  # a mixture's files: present and not empty
        n_tokens = tokenizer_size(config.data)
        if is_token_shards(paths[0]):
            check_token_shards(paths[0], n_tokens, Path(config.data.cache_dir).expanduser())
        check_hf_folders(config.data)  # datasets folders: data files, a column, rows; ids later
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    vocab = config.model.vocab_size
    if vocab is not None and n_tokens > vocab:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's {n_tokens} tokens "
            f"(data.tokenizer={config.data.tokenizer}); remove model.vocab_size to size it "
            "from the tokenizer, or use a smaller tokenizer"
        )
    if config.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision=fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    check_memory(config, world_size, n_tokens)  # last: it plans a layout the checks accept
    return dp


@record  # torchrun reports the failing rank's traceback as the job's root cause
def run(
    argv: list[str] | None,
    prog: str,
    description: str,
    read_config: Callable[[str | None, list[str]], Config],
) -> int:
    """Parse, check, start the process group, train; returns the exit code."""
    args = parse_args(argv, prog, description)
    try:
        config = read_config(args.config, args.overrides)
        warning = slow_bf16_warning(config.train.precision) if _first_rank() else None
        if warning is not None:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        dp = check_before_start(config, world_size_from_env())
        candidate = resume_candidate(config)  # its files' sizes; the hashes need the group
    except ConfigError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    env = init_distributed(config.dist_timeout_s)
    try:
        # Each file hashed by one rank, one all-reduce: every rank resumes from the same
        # checkpoint or raises the same error naming the same file.
        resume = verify_resume(config, candidate, env.world)
        train(config, env, dp, resume)
        code = 0
    except ConfigError as error:  # found after start-up (e.g. the tokenizer's size): all ranks
        if env.is_main:
            print(f"error: {one_line(error)}", file=sys.stderr)
        code = 2
    except NonFiniteLoss as error:  # every rank alike
        if env.is_main:
            print(f"error: {error}", file=sys.stderr)
        code = error.exit_code
    # Any other exception may be this rank's alone: it propagates without the shutdown
    # barrier, which would wait forever for ranks stuck in a collective. The process exits,
    # its peers' collectives fail on the closed connection, and torchrun ends the job.
    shutdown(env)
    return code


def _first_rank() -> bool:
    """Rank 0 of a torchrun job (or a process on its own), before any process group."""
    return os.environ.get("RANK", "0") == "0"


def one_line(error: Exception) -> str:
    """The message on one line: a library's multi-line message would read as a crash."""
    return " ".join(str(error).split())
