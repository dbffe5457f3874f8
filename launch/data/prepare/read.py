"""Reading a corpus for preparation: documents streamed from each file (text paragraph by
paragraph, jsonl line by line, parquet batch by batch), with the file's raw bytes hashed
while they are read, and the cheap fingerprints the token cache is keyed by.

Nothing here holds more than one read chunk of a file: `datasets.load_dataset` would
write an arrow copy of the whole corpus first, which is what preparation must not do.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import xxhash

from launch.data.hf_folders import data_files

# The sampled hash reads this many blocks of this size, spread evenly over the file (the
# first and the last included): 16 x 64 KiB = 1 MiB read whatever the file's size.
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK_BYTES = 1 << 16
_CHUNK_CHARS = 1 << 20
_TEXT_SUFFIXES = {".txt", ".text", ".md"}
_JSON_SUFFIXES = {".jsonl", ".json"}
_COMPRESSED = {".gz", ".bz2", ".xz", ".zst"}


def file_format(path: Path) -> str:
    """text | json | parquet, from the name; ValueError naming the file otherwise."""
    suffixes = [s.lower() for s in path.suffixes if s.lower() not in _COMPRESSED]
    last = suffixes[-1] if suffixes else ""
    if last in _TEXT_SUFFIXES:
        return "text"
    if last in _JSON_SUFFIXES:
        return "json"
    if last == ".parquet":
        return "parquet"
    raise ValueError(f"data.files: cannot tell the format of {path}; use .txt, .jsonl or .parquet")


def sampled_hash(path: Path) -> str:
    """xxh3-128 of the size and SAMPLE_BLOCKS blocks spread over the file: a start-up
    check that costs 1 MiB of reading, not the file. It sees any change of size and any
    change inside a sampled block, not a same-size edit elsewhere (data.verify=full)."""
    size = path.stat().st_size
    digest = xxhash.xxh3_128(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            digest.update(f.read())
            return digest.hexdigest()
        span = size - SAMPLE_BLOCK_BYTES
        for i in range(SAMPLE_BLOCKS):
            f.seek(span * i // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def full_hash(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def input_fingerprint(path: Path) -> str:
    """What the cache key knows of an input file: size, modification time, sampled hash.
    A copy to another machine gets a new mtime and is prepared again there: once per node.
    A datasets folder (launch.data.hf_folders): the same of each of its data files, named
    relative to it, so editing, adding or removing one changes the key."""
    if path.is_dir():
        kind, files = data_files(path)
        parts = [f"{f.relative_to(path)}={input_fingerprint(f)}" for f in files]
        return f"{kind}[{';'.join(parts)}]"
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}:{sampled_hash(path)}"


def input_files(path: Path) -> tuple[Path, ...]:
    """The files an input reads: itself, or a datasets folder's data files."""
    return data_files(path)[1] if path.is_dir() else (path,)


def content_hash(path: Path) -> str:
    """xxh3-128 of every byte an input reads (a folder's data files one after another)."""
    digest = xxhash.xxh3_128()
    for file in input_files(path):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


class HashingReader(io.RawIOBase):
    """A binary file whose bytes are hashed (xxh3-128) and counted as they are read, so the
    full content hash costs no second pass over the input."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed with this reader)
        self.digest = xxhash.xxh3_128()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = self._file.readinto(buffer)
        if n:
            self.digest.update(memoryview(buffer)[:n])
            self.bytes_read += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def iter_file_documents(path: Path, text_field: str, raw: HashingReader) -> Iterator[str]:
    """The documents of one file read through `raw`: a text file's paragraphs (split at
    blank lines, each ending in one blank line, as datasets' `sample_by="paragraph"`
    splits them), or each jsonl/parquet record's `text_field`."""
    kind = file_format(path)
    if kind == "parquet":
        yield from _parquet_documents(path, text_field, raw)
        return
    binary: io.IOBase = io.BufferedReader(raw, 1 << 20)
    if path.suffix.lower() == ".gz":
        binary = gzip.GzipFile(fileobj=binary)  # type: ignore[assignment]
    with io.TextIOWrapper(binary, encoding="utf-8") as text:  # type: ignore[arg-type]
        if kind == "text":
            yield from _paragraphs(text)
        else:
            yield from _jsonl_documents(path, text, text_field)


def _paragraphs(text: io.TextIOWrapper) -> Iterator[str]:
    carry = ""
    while True:
        chunk = text.read(_CHUNK_CHARS)
        if not chunk:
            break
        pieces = (carry + chunk + text.readline()).split("\n\n")  # finish the line first
        carry = pieces.pop()
        for piece in pieces:
            if piece:
                yield piece.rstrip("\n") + "\n\n"
    if carry:
        yield carry.rstrip("\n") + "\n\n"


def _jsonl_documents(path: Path, text: io.TextIOWrapper, field: str) -> Iterator[str]:
    for number, line in enumerate(text, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path}:{number}: not valid JSON ({error.msg}); fix or remove the line"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a record must be a JSON object")
        if field not in record:
            raise ValueError(
                f"{path}:{number} has no '{field}' field (fields: {', '.join(record)}); "
                "set data.text_field"
            )
        if record[field] is not None:
            yield record[field]


def _parquet_documents(path: Path, field: str, raw: HashingReader) -> Iterator[str]:
    import pyarrow.parquet as pq

    # Parquet is read by seeking (footer first), so its bytes are hashed in one pass of
    # their own through `raw` before the batches are read.
    while raw.read(1 << 22):
        pass
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's message does not name the file
        raise ValueError(f"{path}: not a readable parquet file ({error})") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise ValueError(
            f"{path} has no '{field}' field (fields: {', '.join(names)}); set data.text_field"
        )
    for batch in parquet.iter_batches(batch_size=4096, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def total_bytes(paths: list[Path]) -> int:
    """The inputs' size on disk, a datasets folder's data files counted."""
    return sum(os.path.getsize(f) for p in paths for f in input_files(p))
