"""Data pipeline: files -> tokenizer -> packed token file -> train/validation windows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from launch.config import DataConfig
from launch.data.prepare.corpus import resolve_workers
from launch.data.sampler import DistributedBatches, TokenWindows, eval_batches
from launch.data.shards import TokenShards, is_token_shards
from launch.data.token_file import (
    Verify,
    build_token_file,
    corpus_fingerprint,
    iter_documents,
    resolve_files,
)
from launch.data.tokenizers import gpt2_tokenizer, load_tokenizer_folder, train_bpe_tokenizer


@dataclass
class PreparedData:
    tokenizer: PreTrainedTokenizerBase
    train_tokens: np.ndarray | TokenShards  # either reads as a 1-D token array
    val_tokens: np.ndarray | TokenShards


def load_tokenizer(config: DataConfig, paths: list[Path] | None = None) -> PreTrainedTokenizerBase:
    cache_dir = Path(config.cache_dir).expanduser()
    if config.tokenizer == "gpt2":
        return gpt2_tokenizer()
    if config.tokenizer == "bpe":
        paths = paths or resolve_files(config.files)
        return train_bpe_tokenizer(
            lambda: iter_documents(paths, config.text_field, cache_dir),
            config.bpe_vocab_size,
            corpus_fingerprint(paths, config.text_field),
            cache_dir,
        )
    return load_tokenizer_folder(config.tokenizer)


def prepare_data(
    config: DataConfig, verify: Verify | None = None, progress: bool | None = False
) -> PreparedData:
    """Tokenize (or reuse the cache) and split: the last `val_fraction` of tokens validate.

    Idempotent and cached: in a job, one rank per node runs it first (checking the cache
    as `data.verify` says, or preparing it with `data.workers` processes), the others
    after it, with `verify="none"`, and find everything in the cache.
    """
    paths = resolve_files(config.files)
    cache_dir = Path(config.cache_dir).expanduser()
    tokenizer = load_tokenizer(config, paths)
    if is_token_shards(paths[0]):  # pre-tokenized shards: read in place; ids checked once
        verify = verify or config.verify
        stamps = None if verify == "full" else cache_dir  # full: scan at every start
        tokens = TokenShards(paths[0], len(tokenizer), verify != "none", stamps)
        n_train = int(len(tokens) * (1.0 - config.val_fraction))
        return PreparedData(tokenizer, tokens[:n_train], tokens[n_train:])
    workers = resolve_workers(config.workers, paths)
    token_file = build_token_file(
        paths, tokenizer, config.text_field, cache_dir, verify or config.verify, workers, progress
    )
    tokens = token_file.open()
    n_train = int(len(tokens) * (1.0 - config.val_fraction))
    return PreparedData(tokenizer, tokens[:n_train], tokens[n_train:])


__all__ = [
    "DistributedBatches",
    "PreparedData",
    "TokenWindows",
    "eval_batches",
    "load_tokenizer",
    "prepare_data",
]
