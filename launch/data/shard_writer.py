"""Writing a token-shard folder (the format: launch.data.shards) from arrays, streaming.

Separate from the reader, launch.data.shards, which re-exports `write_token_shards`: a
training run only reads shards, and the writer's checks of its input (dtype, vocab_size,
every id) and its numbered, hashed shard files are a job of their own.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from launch.data.shard_format import DTYPES, FORMAT, MANIFEST, Shard


def write_token_shards(
    folder: str | Path,
    arrays: np.ndarray | Iterable[np.ndarray],
    dtype: str = "uint16",
    vocab_size: int = 50257,
    tokens_per_shard: int = 1 << 28,
    documents: bool = True,
) -> Path:
    """Write `arrays` (one 1-D integer array per document, or a single array) to a new
    token-shard folder and return the manifest's path.

    Streaming: each array is checked (ids in [0, vocab_size)), converted and appended to
    the current shard, split across shards at `tokens_per_shard`. Files are written under
    temporary names and renamed when complete; the manifest comes last, so a folder with a
    manifest is always whole.
    """
    folder = Path(folder)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    limit = np.iinfo(DTYPES[dtype]).max + 1
    if not 0 < vocab_size <= limit:
        raise ValueError(f"vocab_size {vocab_size} does not fit {dtype} (1..{limit}); use uint32")
    if tokens_per_shard < 1:
        raise ValueError(f"tokens_per_shard must be positive, not {tokens_per_shard}")
    if (folder / MANIFEST).exists():
        raise ValueError(f"{folder} already holds a {MANIFEST}; write to a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(folder, DTYPES[dtype], tokens_per_shard, documents)
    for number, tokens in enumerate([arrays] if isinstance(arrays, np.ndarray) else arrays):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise ValueError(f"array {number}: expected 1-D integer token ids, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
            raise ValueError(
                f"array {number}, offset {bad[0]}: token id {tokens[bad[0]]} is outside "
                f"the vocabulary [0, {vocab_size})"
            )
        writer.add(tokens.astype(DTYPES[dtype], copy=False))
    shards, docs = writer.close()
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": int(vocab_size),
        "shards": [vars(s) for s in shards],
    }
    if documents:
        manifest["documents"] = docs
    temporary = folder / f"{MANIFEST}.tmp{os.getpid()}"
    temporary.write_text(json.dumps(manifest, indent=1))
    temporary.replace(folder / MANIFEST)
    return folder / MANIFEST


class _ShardWriter:
    """Appends documents to numbered shard files, hashing as it writes."""

    def __init__(self, folder: Path, dtype: np.dtype, per_shard: int, documents: bool) -> None:
        self.folder, self.dtype, self.per_shard, self.documents = (
            folder,
            dtype,
            per_shard,
            documents,
        )
        self.shards: list[Shard] = []
        self.docs: list[dict[str, Any]] = []
        self.file: Any = None

    def add(self, tokens: np.ndarray) -> None:
        if self.file is None or self.filled == self.per_shard:
            self._next_shard()
        if self.documents:
            self.starts.append(self.filled)  # a document, even an empty one, starts here
        while tokens.size:
            if self.filled == self.per_shard:
                self._next_shard()
            piece, tokens = np.split(tokens, [self.per_shard - self.filled])
            data = memoryview(np.ascontiguousarray(piece)).cast("B")
            self.file.write(data)
            self.digest.update(data)
            self.filled += piece.size

    def close(self) -> tuple[list[Shard], list[dict[str, Any]]]:
        if self.file is not None:
            self._finish_shard()
        if not any(shard.n_tokens for shard in self.shards):
            raise ValueError(f"{self.folder}: the arrays hold no tokens; nothing to write")
        return self.shards, self.docs

    def _next_shard(self) -> None:
        if self.file is not None:
            self._finish_shard()
        self.name = f"shard-{len(self.shards):05d}"
        self.file = open(self.folder / f"{self.name}.bin.tmp", "wb")  # noqa: SIM115 (closed in _finish_shard)
        self.digest, self.filled, self.starts = xxhash.xxh3_64(), 0, array("Q")

    def _finish_shard(self) -> None:
        self.file.close()
        (self.folder / f"{self.name}.bin.tmp").replace(self.folder / f"{self.name}.bin")
        self.shards.append(Shard(f"{self.name}.bin", self.filled, self.digest.hexdigest()))
        if self.documents:
            starts = np.frombuffer(self.starts, dtype=np.uint64).astype("<u8")
            starts.tofile(self.folder / f"{self.name}.docs")
            self.docs.append({"file": f"{self.name}.docs", "n_documents": len(starts)})
