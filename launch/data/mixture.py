"""Several corpora mixed by weight (`data.mixture`), each with its own token cache.

Global sample index -> (source, the source's own sample index) -> window id. Samples are
taken in blocks of BLOCK: in every block, source i owns exactly counts[i] slots (its share
of BLOCK by largest remainder), and a permutation keyed by (seed, block) deals the slots
out. Source i's k-th sample (in order of the global index) is then a window of its own
ShuffledSampler, so each source has its own epochs.
Everything is a function of the seed and the global sample index, so a run resumes, and
changes dp, exactly as with one corpus (launch.data.sampler.DistributedBatches).

The sources are numbered into one id space (source i's windows after those of sources
0..i-1), so DistributedBatches walks a mixture like any other Samples.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from launch.config import DataConfig, MixtureSource
from launch.data import PreparedData, load_tokenizer, prepare_data
from launch.data.examples import is_prompt_completion
from launch.data.sampler import (
    FeistelPermutation,
    Samples,
    ShuffledSampler,
    TokenWindows,
    eval_batches,
)
from launch.data.token_file import resolve_files
from launch.data.tokenizers import tokenizer_fingerprint

BLOCK = 1024  # per-block counts are exact, so any 1024 consecutive samples hold each share
ORDER_STREAM = 2**31  # the block order's key stream; source i's sampler uses stream 1 + i


def block_counts(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Each source's samples in a block: its share of `block`, rounded by largest remainder
    so the counts sum to `block` exactly (ties go to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    quota = w / w.sum() * block
    counts = np.floor(quota).astype(np.int64)
    short = block - int(counts.sum())
    counts[np.argsort(counts - quota, kind="stable")[:short]] += 1
    return counts


class MixtureSampler:
    """Global sample index -> id in the mixture's id space (see the module's note)."""

    def __init__(
        self, sizes: Sequence[int], weights: Sequence[float], seed: int, block: int = BLOCK
    ) -> None:
        self.counts = block_counts(weights, block)
        self.ends = np.cumsum(self.counts)  # slots [ends[i] - counts[i], ends[i]) are source i's
        self.offsets = np.cumsum([0, *sizes])[:-1]
        self.sources = [ShuffledSampler(n, seed, stream=1 + i) for i, n in enumerate(sizes)]
        self.seed, self.block = seed, block
        self._dealt: tuple[int, np.ndarray, np.ndarray] = (-1, self.ends, self.ends)

    def draw(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's own sample index) of each global sample index."""
        block, position = np.divmod(np.asarray(index, dtype=np.int64), self.block)
        source, k = np.empty_like(position), np.empty_like(position)
        for b in np.unique(block):
            chosen = block == b
            owner, rank = self._deal(int(b))
            source[chosen] = owner[position[chosen]]
            k[chosen] = b * self.counts[source[chosen]] + rank[position[chosen]]
        return source, k

    def _deal(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """For each position of a block: its source, and how many of that source's samples
        come before it in the block. A source thus takes its own sample indices in order,
        so its epochs follow one another. O(block) memory, the last block kept."""
        if self._dealt[0] != block:
            order = FeistelPermutation(self.block, (self.seed, ORDER_STREAM, block))
            owner = np.searchsorted(self.ends, order(np.arange(self.block)), side="right")
            by_source = np.argsort(owner, kind="stable")  # each source's positions, in order
            rank = np.empty(self.block, dtype=np.int64)
            rank[by_source] = np.arange(self.block) - (self.ends - self.counts)[owner[by_source]]
            self._dealt = (block, owner, rank)
        return self._dealt[1], self._dealt[2]

    def window_ids(self, start: int, count: int) -> np.ndarray:
        source, k = self.draw(np.arange(start, start + count, dtype=np.int64))
        ids = np.empty(count, dtype=np.int64)
        for i in np.unique(source):
            chosen = source == i
            ids[chosen] = self.offsets[i] + self.sources[i].ids_at(k[chosen])
        return ids


class MixtureWindows:
    """The sources' windows in one id space; brings its own sampler (by weight)."""

    def __init__(
        self, parts: Sequence[TokenWindows], weights: Sequence[float], names: Sequence[str]
    ) -> None:
        self.parts, self.weights, self.names = list(parts), list(weights), list(names)
        self.offsets = np.cumsum([0, *(len(p) for p in self.parts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler([len(p) for p in self.parts], self.weights, seed)

    def batch(self, ids: np.ndarray) -> torch.Tensor:
        ids = np.asarray(ids, dtype=np.int64)
        source = np.searchsorted(self.offsets, ids, side="right") - 1
        rows = torch.empty((len(ids), self.parts[0].seq_len + 1), dtype=torch.int64)
        for i in np.unique(source):
            chosen = np.flatnonzero(source == i)
            rows[torch.from_numpy(chosen)] = self.parts[i].batch(ids[chosen] - self.offsets[i])
        return rows


def source_names(mixture: Sequence[MixtureSource]) -> list[str]:
    """Each source's name in the metrics (`val_loss/<name>`): its first file's stem, or
    `<index>-<stem>` where two sources' stems coincide."""
    stems = [Path(s.files[0]).name.split(".")[0] for s in mixture]
    return [stem if stems.count(stem) == 1 else f"{i}-{stem}" for i, stem in enumerate(stems)]


def check_sources(data: DataConfig) -> None:
    """Without reading any text: every source's files exist, and none is empty."""
    for i, source in enumerate(data.mixture):
        try:
            paths = resolve_files(source.files)
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(f"data.mixture[{i}]: {error}") from None
        for path in paths:
            if path.stat().st_size == 0:
                raise ValueError(
                    f"data.mixture[{i}]: {path} is empty; give the source files that hold "
                    "text, or remove it"
                )


def load_mixture(
    data: DataConfig,
    window: int,
    prepare: Callable[[DataConfig], PreparedData] = prepare_data,
) -> tuple[PreTrainedTokenizerBase, MixtureWindows, MixtureWindows, str]:
    """(tokenizer, train, val, description) of `data.mixture`: each source prepared by
    `prepare` (prepare_data: its own cache, keyed by its files), all with one tokenizer,
    split by data.val_fraction and cut into windows."""
    check_sources(data)
    shared = shared_tokenizer(data)
    names, weights = source_names(data.mixture), [s.weight for s in data.mixture]
    tokenizer, train, val, sizes = None, [], [], []
    for i, source in enumerate(data.mixture):
        where = f"data.mixture[{i}] ({', '.join(source.files)})"
        if is_prompt_completion(resolve_files(source.files)):
            raise ValueError(f"{where}: prompt/completion files cannot be mixed; give text")
        try:
            prepared = prepare(dataclasses.replace(shared, files=list(source.files), mixture=[]))
            if not _has_text(prepared, 2 * window + 2):
                raise ValueError(
                    "holds no text; give the source files that hold text, or remove it"
                )
            train.append(TokenWindows(prepared.train_tokens, window))
            val.append(TokenWindows(prepared.val_tokens, window))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        tokenizer = tokenizer or prepared.tokenizer
        sizes.append(len(prepared.train_tokens))
    total = sum(weights)
    rows = zip(names, weights, sizes, strict=True)
    shares = [f"{n} {w / total:.0%} ({k:,} tokens)" for n, w, k in rows]
    description = "train mixture " + " + ".join(shares)
    return (
        tokenizer,
        MixtureWindows(train, weights, names),
        MixtureWindows(val, weights, names),
        description,
    )


def validation_sets(
    val: Samples, n_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[tuple[str, float, list[Any]]]:
    """(metrics key, weight, batches) of each validation set: `val_loss` alone, or for a
    mixture `val_loss/<source>` per source (the first `n_samples` windows of each)."""
    if not isinstance(val, MixtureWindows):
        return [("val_loss", 1.0, eval_batches(val, n_samples, micro_batch_size, dp_rank, dp_size))]
    return [
        (
            f"val_loss/{name}",
            weight,
            eval_batches(part, n_samples, micro_batch_size, dp_rank, dp_size),
        )
        for name, weight, part in zip(val.names, val.weights, val.parts, strict=True)
    ]


def _has_text(prepared: PreparedData, few: int) -> bool:
    """False when the tokens are only document separators (files of empty records). Only
    a source of under `few` tokens is read: any larger one holds text."""
    tokens = [prepared.train_tokens, prepared.val_tokens]
    if sum(len(t) for t in tokens) >= few:
        return True
    return any(np.any(t != prepared.tokenizer.eos_token_id) for t in tokens)


def shared_tokenizer(data: DataConfig) -> DataConfig:
    """The data config every source is prepared with. gpt2 and tokenizer folders encode
    alike whatever the files; a `bpe` is trained once, on all the sources' files together,
    and written as a folder (vocab.json + merges.txt) that each source then loads, so the
    sources share one vocabulary instead of each training its own."""
    if data.tokenizer != "bpe":
        return data
    files = [f for source in data.mixture for f in source.files]
    tokenizer = load_tokenizer(dataclasses.replace(data, files=files, mixture=[]))
    cache_dir = Path(data.cache_dir).expanduser()
    folder = cache_dir / "tokenizers" / f"mixture-{tokenizer_fingerprint(tokenizer)[:16]}"
    if not (folder / "merges.txt").is_file():
        partial = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        partial.mkdir(parents=True, exist_ok=True)
        tokenizer.backend_tokenizer.model.save(str(partial))
        try:
            partial.replace(folder)  # atomic: a reader never sees half a folder
        except OSError:  # another node wrote it first (a shared cache)
            shutil.rmtree(partial)
            if not (folder / "merges.txt").is_file():
                raise
    return dataclasses.replace(data, tokenizer=str(folder))
