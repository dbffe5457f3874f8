"""The command line shared by launch.pretrain and launch.finetune: read and check the
config before any process group exists, then run the job.

Every error found before start-up is one line on stderr and exit code 2, on every rank
alike, so a bad config never leaves a half-started job behind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from hybrid.distributed import init_distributed, shutdown, world_size_from_env

from .checkpointing import resume_from
from .config import Config, ConfigError, validate_layout
from .data.token_file import resolve_files
from .data.tokenizers import load_tokenizer_folder
from .training import train


def parse_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. train.lr=3e-4 parallel.tp=2")
    return parser.parse_args(argv)


def check_before_start(config: Config, world_size: int) -> int:
    """Everything that can be checked without a process group; returns dp."""
    dp = validate_layout(config, world_size)
    try:
        resolve_files(config.data.files)
        if config.data.tokenizer not in ("gpt2", "bpe"):
            load_tokenizer_folder(config.data.tokenizer)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    if config.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision=fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    return dp


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
        dp = check_before_start(config, world_size_from_env())
        resume = resume_from(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    env = init_distributed(config.dist_timeout_s)
    try:
        train(config, env, dp, resume)
    except ConfigError as error:  # found after start-up (e.g. the tokenizer's size): all ranks
        if env.is_main:
            print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        shutdown(env)
    return 0
