"""Local text, jsonl and parquet files -> one packed token file, cached.

The token file is a flat numpy array on disk (uint16 when every id fits, else uint32),
opened as a read-only memmap, so every rank shares the page cache instead of holding a
copy. Its name hashes the input files' bytes and the tokenizer, so a change to either
builds a new file and a stale one is never read. Files are written under a temporary name
and renamed when complete: a crash mid-build leaves no half file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from hybrid.checkpoint_files import file_sha256

from .jsonl import read_jsonl
from .tokenizers import ASSETS, tokenizer_fingerprint

BUNDLED_CORPUS = ASSETS / "shakespeare.txt.gz"
FORMAT_VERSION = "tokens-v3"  # v3: meta.json records the SHA-256 of tokens.bin
_TEXT_SUFFIXES = {".txt", ".text", ".md"}
_JSON_SUFFIXES = {".jsonl", ".json"}


@dataclass(frozen=True)
class TokenFile:
    path: Path
    dtype: np.dtype
    n_tokens: int

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


def resolve_files(files: list[str]) -> list[Path]:
    """The user's files, or the bundled Shakespeare corpus when none are given."""
    if not files:
        return [BUNDLED_CORPUS]
    paths = [Path(f).expanduser() for f in files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"data.files: {path} does not exist or is not a file")
        _file_format(path)  # unknown extensions fail here, before any work
    return paths


def corpus_fingerprint(paths: list[Path], text_field: str) -> str:
    digest = hashlib.sha256(f"{FORMAT_VERSION}|{text_field}".encode())
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0file\0")
    return digest.hexdigest()


def iter_documents(paths: list[Path], text_field: str, cache_dir: Path) -> Iterator[str]:
    """Yield text pieces in order. A text file is read paragraph by paragraph (its blank
    lines restored); a jsonl or parquet record is one document."""
    import datasets  # here: about 1 s of start-up that a cached token file never needs

    datasets.disable_progress_bars()  # one bar per file is noise next to training's
    for path in paths:
        kind = _file_format(path)
        options = {"sample_by": "paragraph"} if kind == "text" else {}
        try:
            table = datasets.load_dataset(
                kind, data_files=[str(path)], split="train", cache_dir=str(cache_dir / "hf"),
                **options,
            )  # fmt: skip
        except Exception as error:  # datasets' message names neither the file nor the line
            raise ValueError(_unreadable(path, kind, error)) from None
        column = "text" if kind == "text" else text_field
        if column not in table.column_names:
            raise ValueError(
                f"{path} has no '{column}' field (fields: {', '.join(table.column_names)}); "
                "set data.text_field"
            )
        for row in table:
            text = row[column]
            if text is None:
                continue
            yield text.rstrip("\n") + "\n\n" if kind == "text" else text


def build_token_file(
    paths: list[Path], tokenizer: PreTrainedTokenizerBase, text_field: str, cache_dir: Path
) -> TokenFile:
    """Tokenize `paths` into the cache (once) and return the token file.

    Documents are separated by the tokenizer's end-of-text token: after every jsonl or
    parquet record, and at the end of each text file.
    """
    key = hashlib.sha256(
        f"{corpus_fingerprint(paths, text_field)}|{tokenizer_fingerprint(tokenizer)}".encode()
    ).hexdigest()[:20]
    folder = cache_dir / "tokens" / key
    meta_path = folder / "meta.json"
    cached = _cached_token_file(folder)
    if cached is not None:
        return cached
    n_ids = len(tokenizer)
    dtype = np.dtype(np.uint16 if n_ids <= np.iinfo(np.uint16).max + 1 else np.uint32)
    pieces = list(_encode(paths, tokenizer, text_field, cache_dir, dtype))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    if tokens.size == 0:
        raise ValueError(f"the corpus {', '.join(map(str, paths))} holds no text to train on")
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp{os.getpid()}"
    tokens.tofile(folder / f"tokens.bin{suffix}")
    (folder / f"tokens.bin{suffix}").replace(folder / "tokens.bin")
    meta = {
        "dtype": dtype.name,
        "n_tokens": int(tokens.size),
        "n_bytes": int(tokens.nbytes),
        "sha256": file_sha256(folder / "tokens.bin"),
        "vocab": n_ids,
        "files": [str(p) for p in paths],
    }
    (folder / f"meta.json{suffix}").write_text(json.dumps(meta, indent=1))
    (folder / f"meta.json{suffix}").replace(meta_path)  # written last: marks the file complete
    return TokenFile(folder / "tokens.bin", dtype, int(tokens.size))


def _unreadable(path: Path, kind: str, error: Exception) -> str:
    """What is wrong with a file datasets could not read: for jsonl, the first line that
    is not a JSON object."""
    if kind == "json":
        try:
            for number, record in read_jsonl(path):
                if not isinstance(record, dict):
                    return f"{path}:{number}: a record must be a JSON object"
        except (ValueError, UnicodeDecodeError) as bad:
            return str(bad)
    return f"{path}: not a readable {kind} file ({type(error).__name__}: {error})"


def _cached_token_file(folder: Path) -> TokenFile | None:
    """The cached token file if it is whole and unaltered (size and SHA-256 as recorded
    when it was built); else None, after a warning, and the caller rebuilds it: the cache
    is derived data, so rebuilding is always safe."""
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
        elif file_sha256(path) != meta["sha256"]:
            problem = "tokens.bin does not match its recorded SHA-256"
    except (ValueError, KeyError, TypeError) as error:
        problem = f"meta.json is unreadable ({error})"
    if problem is None:
        return token_file
    warnings.warn(f"token cache {folder} is corrupt: {problem}; rebuilding it", stacklevel=3)
    return None


def _encode(
    paths: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    cache_dir: Path,
    dtype: np.dtype,
    batch_size: int = 1024,
) -> Iterator[np.ndarray]:
    eos = tokenizer.eos_token_id
    for path in paths:
        per_record = _file_format(path) != "text"
        batch: list[str] = []
        for text in [*iter_documents([path], text_field, cache_dir), None]:
            if text is not None:
                batch.append(text)
            if batch and (text is None or len(batch) == batch_size):
                for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                    yield np.asarray(ids + ([eos] if per_record and eos is not None else []), dtype)
                batch = []
        if not per_record and eos is not None:
            yield np.asarray([eos], dtype)


def _file_format(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes if s.lower() not in (".gz", ".bz2", ".xz", ".zst")]
    last = suffixes[-1] if suffixes else ""
    if last in _TEXT_SUFFIXES:
        return "text"
    if last in _JSON_SUFFIXES:
        return "json"
    if last == ".parquet":
        return "parquet"
    raise ValueError(f"data.files: cannot tell the format of {path}; use .txt, .jsonl or .parquet")
