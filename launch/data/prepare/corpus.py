"""Streaming corpus preparation: input files -> one token file and a document index.

Documents stream from each file (launch.data.prepare.read) in batches of about 1 MB of
text to N worker processes (launch.data.prepare.encode), each with its own copy of the
tokenizer's Rust backend (`tokenizers`); the results come back in order and are appended
to the file's part as they arrive. At most 2N batches are in flight, so memory does not
grow with the corpus.

Each input file becomes one part (`parts/<i>.bin` + `.docs` + `.json`), renamed into place
when complete: a crash loses only the file being tokenized, and a rerun keeps the parts
already finished. The last step joins the parts into `tokens.bin` and `docs.bin` (int64
start offset of every document: a document ends with the end-of-text token, after each
jsonl or parquet record and at the end of each text file) and writes `meta.json` last,
the cache's completion marker.

A local datasets folder (launch.data.hf_folders) is one input, read streaming, record
batch by record batch: a text row is one document, tokenized as above; an `input_ids` row
is appended as it is (no tokenizer, no end-of-text added: the ids are the user's), each
id checked against the vocabulary, and indexed in docs.bin as one document.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from launch.data.hf_folders import id_batches, open_hf_folder
from launch.data.prepare.encode import _encoded, _init_worker
from launch.data.prepare.read import (
    HashingReader,
    content_hash,
    file_format,
    input_fingerprint,
    iter_file_documents,
    sampled_hash,
    total_bytes,
)

BATCH_CHARS = 1 << 20  # text per batch sent to a worker: large enough to amortise pickling
# Below this much input, starting worker processes costs more than it saves.
MIN_BYTES_PER_WORKER = 8 << 20


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32)


def resolve_workers(workers: int, paths: list[Path]) -> int:
    """`data.workers` (0: one per core), but 1 for a corpus too small to be worth it."""
    n = workers or os.cpu_count() or 1
    return max(1, min(n, total_bytes(paths) // MIN_BYTES_PER_WORKER))


def prepare_corpus(
    paths: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    folder: Path,
    workers: int = 1,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Tokenize `paths` into `folder` (tokens.bin, docs.bin, meta.json) and return the
    meta. `workers` processes tokenize (1: in this process). `progress`: a tqdm bar with
    MB/s and ETA (None: when stderr is a terminal)."""
    dtype = token_dtype(tokenizer)
    parts_dir = folder / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=total_bytes(paths), unit="B", unit_scale=True, desc="tokenizing",
        disable=None if progress is None else not progress, smoothing=0.1,
    )  # fmt: skip
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pool = None
    if workers > 1 and backend is not None:
        context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        pool = context.Pool(workers, _init_worker, (backend.to_str(),))
    parts = []
    try:
        for index, path in enumerate(paths):
            part = _finished_part(parts_dir, index, path)
            if part is None:
                part = _write_part(
                    parts_dir, index, path, tokenizer, text_field, dtype, pool, workers, bar
                )
            else:
                bar.update(total_bytes([path]))  # kept from an earlier, interrupted run
            parts.append(part)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    n_tokens = sum(p["n_tokens"] for p in parts)
    if n_tokens == 0:
        raise ValueError(f"the corpus {', '.join(map(str, paths))} holds no text to train on")
    tokens_hash = _join_parts(parts_dir, parts, folder, dtype)
    meta = {
        "dtype": dtype.name,
        "n_tokens": n_tokens,
        "n_bytes": n_tokens * dtype.itemsize,
        "n_docs": sum(p["n_docs"] for p in parts),
        "xxh3_128": tokens_hash,  # of tokens.bin, taken while writing it
        "sampled_xxh3_128": sampled_hash(folder / "tokens.bin"),
        "vocab": len(tokenizer),
        "files": [{"path": p["path"], "xxh3_128": p["input_xxh3_128"]} for p in parts],
    }
    partial = folder / f"meta.json.tmp{os.getpid()}"
    partial.write_text(json.dumps(meta, indent=1))
    partial.replace(folder / "meta.json")  # written last: marks the cache complete
    shutil.rmtree(parts_dir, ignore_errors=True)
    return meta


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _part_name(index: int, path: Path) -> str:
    return f"{index:05d}-{xxhash.xxh3_64_hexdigest(input_fingerprint(path).encode())}"


def _finished_part(parts_dir: Path, index: int, path: Path) -> dict[str, Any] | None:
    """The part of input `index` if an earlier run finished it (same input file, whole)."""
    name = _part_name(index, path)
    try:
        part = json.loads((parts_dir / f"{name}.json").read_text())
        whole = (parts_dir / f"{name}.bin").stat().st_size == part["n_bytes"]
        return part if whole else None
    except (OSError, ValueError, KeyError):
        return None


def _write_part(
    parts_dir: Path,
    index: int,
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    dtype: np.dtype,
    pool: Any,
    workers: int,
    bar: tqdm,
) -> dict[str, Any]:
    if path.is_dir():
        return _write_folder_part(
            parts_dir, index, path, tokenizer, text_field, dtype, pool, workers, bar
        )
    name = _part_name(index, path)
    per_record = file_format(path) != "text"
    eos = tokenizer.eos_token_id
    raw = HashingReader(path)
    suffix = f".tmp{os.getpid()}"
    tokens_tmp, docs_tmp = parts_dir / f"{name}.bin{suffix}", parts_dir / f"{name}.docs{suffix}"
    digest = xxhash.xxh3_128()
    n_tokens, n_docs, seen = 0, 0, 0
    try:
        with open(tokens_tmp, "wb") as tokens_out, open(docs_tmp, "wb") as docs_out:
            documents = iter_file_documents(path, text_field, raw)
            encoded = _encoded(
                _batches(documents), tokenizer, dtype, eos if per_record else None, pool,
                2 * workers,
            )  # fmt: skip
            if not per_record:
                docs_out.write(np.zeros(1, np.int64).tobytes())  # a text file: one document
                n_docs = 1
            for flat, lengths in encoded:
                if per_record:
                    starts = n_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                    docs_out.write(starts.astype(np.int64).tobytes())
                    n_docs += len(lengths)
                tokens_out.write(flat.tobytes())
                digest.update(flat.tobytes())
                n_tokens += len(flat)
                bar.update(raw.bytes_read - seen)
                seen = raw.bytes_read
            if not per_record and eos is not None and n_tokens:
                tokens_out.write(np.asarray([eos], dtype).tobytes())
                digest.update(np.asarray([eos], dtype).tobytes())
                n_tokens += 1
            if not n_tokens:
                n_docs = 0
                docs_out.truncate(0)
        bar.update(raw.bytes_read - seen)
    finally:
        raw.close()
    # the full content hash, taken while reading
    part = _part(name, path, n_tokens, n_docs, dtype, digest, raw.digest.hexdigest())
    return _finish_part(parts_dir, part, tokens_tmp, docs_tmp)


def _write_folder_part(
    parts_dir: Path,
    index: int,
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    dtype: np.dtype,
    pool: Any,
    workers: int,
    bar: tqdm,
) -> dict[str, Any]:
    """A datasets folder's part: text rows tokenized like parquet records, `input_ids`
    rows checked and appended as they are (see the module)."""
    folder = open_hf_folder(path, text_field)
    name = _part_name(index, path)
    # datasets reads the files itself, so their full hash is one pass of its own (as parquet's)
    input_hash = content_hash(path)
    size, shown = total_bytes([path]), 0
    if folder.pretokenized:
        encoded = id_batches(folder.rows(), path, len(tokenizer), dtype, BATCH_CHARS)
    else:
        texts: Iterator[str] = (text for _, text in folder.rows())  # type: ignore[misc]
        eos = tokenizer.eos_token_id
        encoded = _encoded(_batches(texts), tokenizer, dtype, eos, pool, 2 * workers)
    suffix = f".tmp{os.getpid()}"
    tokens_tmp, docs_tmp = parts_dir / f"{name}.bin{suffix}", parts_dir / f"{name}.docs{suffix}"
    digest = xxhash.xxh3_128()
    n_tokens, n_docs = 0, 0
    with open(tokens_tmp, "wb") as tokens_out, open(docs_tmp, "wb") as docs_out:
        for flat, lengths in encoded:
            starts = n_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
            docs_out.write(starts.astype(np.int64).tobytes())
            tokens_out.write(flat.tobytes())
            digest.update(flat.tobytes())
            n_tokens += len(flat)
            n_docs += len(lengths)
            done = size * min(n_docs, folder.n_rows) // folder.n_rows  # rows read, as bytes
            bar.update(done - shown)
            shown = done
    bar.update(size - shown)
    part = _part(name, path, n_tokens, n_docs, dtype, digest, input_hash)
    return _finish_part(parts_dir, part, tokens_tmp, docs_tmp)


def _part(
    name: str, path: Path, n_tokens: int, n_docs: int, dtype: np.dtype, digest: Any,
    input_hash: str,
) -> dict[str, Any]:  # fmt: skip
    return {
        "name": name,
        "path": str(path),
        "n_tokens": n_tokens,
        "n_bytes": n_tokens * dtype.itemsize,
        "n_docs": n_docs,
        "xxh3_128": digest.hexdigest(),
        "input_xxh3_128": input_hash,
    }


def _finish_part(
    parts_dir: Path, part: dict[str, Any], tokens_tmp: Path, docs_tmp: Path
) -> dict[str, Any]:
    name = part["name"]
    tokens_tmp.replace(parts_dir / f"{name}.bin")
    docs_tmp.replace(parts_dir / f"{name}.docs")
    partial = parts_dir / f"{name}.json.tmp{os.getpid()}"
    partial.write_text(json.dumps(part))
    partial.replace(parts_dir / f"{name}.json")  # last: marks the part finished
    return part


def _join_parts(parts_dir: Path, parts: list[dict[str, Any]], folder: Path, dtype: np.dtype) -> str:
    """tokens.bin and docs.bin from the parts; returns tokens.bin's xxh3-128. One part is
    renamed (no copy); several are copied in order, their document offsets shifted."""
    if len(parts) == 1:
        name = parts[0]["name"]
        (parts_dir / f"{name}.docs").replace(folder / "docs.bin")
        (parts_dir / f"{name}.bin").replace(folder / "tokens.bin")
        return parts[0]["xxh3_128"]
    suffix = f".tmp{os.getpid()}"
    digest = xxhash.xxh3_128()
    offset = 0
    with (
        open(folder / f"tokens.bin{suffix}", "wb") as tokens_out,
        open(folder / f"docs.bin{suffix}", "wb") as docs_out,
    ):
        for part in parts:
            with open(parts_dir / f"{part['name']}.bin", "rb") as f:
                while chunk := f.read(1 << 24):
                    tokens_out.write(chunk)
                    digest.update(chunk)
            if part["n_docs"]:  # in slices: a part may index millions of records
                starts = np.memmap(parts_dir / f"{part['name']}.docs", np.int64, "r")
                for i in range(0, len(starts), 1 << 20):
                    docs_out.write((starts[i : i + (1 << 20)] + offset).tobytes())
            offset += part["n_tokens"]
    (folder / f"docs.bin{suffix}").replace(folder / "docs.bin")
    (folder / f"tokens.bin{suffix}").replace(folder / "tokens.bin")
    return digest.hexdigest()
