"""Local text, jsonl and parquet files -> one packed token file, cached.

The token file is a flat numpy array on disk (uint16 when every id fits, else uint32),
opened as a read-only memmap, so every rank shares the page cache instead of holding a
copy; `docs.bin` beside it holds the start offset of every document. The cache key hashes
each input's size, modification time and a sampled content hash (launch.data.prepare.read),
the text field, the tokenizer and the format version: a start reads about 1 MiB per file,
not the corpus. The full content hash of every input is taken once, while preparing
(launch.data.prepare.corpus), and stored in meta.json, which is written last: a crash mid-build
leaves no complete-looking cache behind.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from launch.data.hf_folders import TOKENS_COLUMN, is_hf_folder, open_hf_folder
from launch.data.prepare.corpus import prepare_corpus
from launch.data.prepare.read import (
    HashingReader,
    file_format,
    full_hash,
    input_fingerprint,
    iter_file_documents,
    sampled_hash,
)
from launch.data.shards import is_token_shards
from launch.data.tokenizers import ASSETS, tokenizer_fingerprint

BUNDLED_CORPUS = ASSETS / "shakespeare.txt.gz"
# v4: streaming preparation, key from sizes/mtimes/sampled hashes, docs.bin, xxh3 hashes
FORMAT_VERSION = "tokens-v4"
Verify = Literal["sample", "full", "none"]


@dataclass(frozen=True)
class TokenFile:
    path: Path
    dtype: np.dtype
    n_tokens: int

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))

    def documents(self) -> np.ndarray:
        """The start offset of every document (int64), as a read-only memmap."""
        return np.memmap(self.path.parent / "docs.bin", dtype=np.int64, mode="r")


def resolve_files(files: list[str]) -> list[Path]:
    """The user's files, or the bundled Shakespeare corpus when none are given, or one
    folder of pre-tokenized shards (launch.data.shards: read in place, not prepared).
    A local datasets folder (launch.data.hf_folders) counts as one input file."""
    if not files:
        return [BUNDLED_CORPUS]
    paths = [Path(f).expanduser() for f in files]
    if len(paths) == 1 and is_token_shards(paths[0]):
        return paths
    for path in paths:
        if is_token_shards(path):
            raise ValueError(
                f"data.files: {path} is a token-shard folder; it must be the only entry "
                "(merge the shards, or give the sources as data.mixture)"
            )
        if path.is_dir() and not is_hf_folder(path):
            raise ValueError(
                f"data.files: {path} is a folder of neither kind read: a token-shard folder "
                "(manifest.json, launch.data.shards; the only entry) or a datasets folder "
                "(parquet files, or save_to_disk's state.json)"
            )
        if path.is_dir():
            continue
        if not path.is_file():
            raise FileNotFoundError(f"data.files: {path} does not exist or is not a file")
        file_format(path)  # unknown extensions fail here, before any work
    return paths


def corpus_fingerprint(paths: list[Path], text_field: str) -> str:
    """A hash of the inputs that costs about 1 MiB of reading per file (see the module)."""
    digest = hashlib.sha256(f"{FORMAT_VERSION}|{text_field}".encode())
    for path in paths:
        digest.update(f"{input_fingerprint(path)}\0file\0".encode())
    return digest.hexdigest()


def token_folder(
    paths: list[Path], tokenizer: PreTrainedTokenizerBase, text_field: str, cache_dir: Path
) -> Path:
    """Where the token file of these inputs and this tokenizer lives in the cache."""
    key = hashlib.sha256(
        f"{corpus_fingerprint(paths, text_field)}|{tokenizer_fingerprint(tokenizer)}".encode()
    ).hexdigest()[:20]
    return cache_dir / "tokens" / key


def iter_documents(
    paths: list[Path], text_field: str, cache_dir: Path | None = None
) -> Iterator[str]:
    """Yield text pieces in order, streaming. A text file is read paragraph by paragraph
    (its blank lines restored); a jsonl or parquet record is one document. (`cache_dir`
    is unused: kept for callers of the datasets-based reader this replaced.) A datasets
    folder's text rows are its documents; its `input_ids` rows are not text."""
    for path in paths:
        if path.is_dir():
            folder = open_hf_folder(path, text_field)
            if folder.pretokenized:
                raise ValueError(
                    f"{path} holds pre-tokenized {TOKENS_COLUMN}, not text; set data.tokenizer "
                    "to the tokenizer of its ids"
                )
            yield from folder.documents()  # type: ignore[misc]
            continue
        raw = HashingReader(path)
        try:
            yield from iter_file_documents(path, text_field, raw)
        finally:
            raw.close()


def build_token_file(
    paths: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    cache_dir: Path,
    verify: Verify = "sample",
    workers: int = 1,
    progress: bool | None = False,
) -> TokenFile:
    """Tokenize `paths` into the cache (once) and return the token file.

    Documents are separated by the tokenizer's end-of-text token: after every jsonl or
    parquet record, and at the end of each text file. A cached file is checked first
    (`verify`: sample = size and sampled hash, full = every byte, none = trust meta.json);
    a corrupt one is rebuilt after a warning.
    """
    folder = token_folder(paths, tokenizer, text_field, cache_dir)
    cached = cached_token_file(folder, verify)
    if cached is not None:
        return cached
    meta = prepare_corpus(paths, tokenizer, text_field, folder, workers, progress)
    return TokenFile(folder / "tokens.bin", np.dtype(meta["dtype"]), int(meta["n_tokens"]))


def cached_token_file(folder: Path, verify: Verify = "sample") -> TokenFile | None:
    """The cached token file if it is whole and unaltered (size and hash as recorded when
    it was built); else None, after a warning, and the caller rebuilds it: the cache is
    derived data, so rebuilding is always safe. None without a warning when absent."""
    meta_path, path = folder / "meta.json", folder / "tokens.bin"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        token_file = TokenFile(path, np.dtype(meta["dtype"]), int(meta["n_tokens"]))
        problem = None
        if not path.is_file():
            problem = "tokens.bin is missing"
        elif path.stat().st_size != meta["n_bytes"]:
            problem = f"tokens.bin has {path.stat().st_size} bytes, not {meta['n_bytes']}"
        elif verify == "sample" and sampled_hash(path) != meta["sampled_xxh3_128"]:
            problem = "tokens.bin does not match its recorded sampled hash"
        elif verify == "full" and full_hash(path) != meta["xxh3_128"]:
            problem = "tokens.bin does not match its recorded hash (data.verify=full)"
    except (ValueError, KeyError, TypeError) as error:
        problem = f"meta.json is unreadable ({error})"
    if problem is None:
        return token_file
    warnings.warn(f"token cache {folder} is corrupt: {problem}; rebuilding it", stacklevel=3)
    (folder / "meta.json").unlink(missing_ok=True)  # rebuilt from scratch, parts and all
    return None
