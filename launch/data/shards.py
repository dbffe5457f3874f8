"""Pre-tokenized corpora in our own format: a folder of raw token shards and a manifest.

    corpus/
      manifest.json
      shard-00000.bin        raw little-endian token ids, no header
      shard-00000.docs       optional: uint64 little-endian start offset (within the shard)
      shard-00001.bin        of each document that begins in the shard
      ...

manifest.json:

    {"format": "hybrid-token-shards/1",
     "dtype": "uint16",                      # or "uint32"; the width of every id
     "vocab_size": 50257,                    # every id is < vocab_size
     "shards": [{"file": "shard-00000.bin", "n_tokens": 268435456, "xxh3": "<hex>"}, ...],
     "documents": [{"file": "shard-00000.docs", "n_documents": 1234}, ...]}   # optional

`xxh3` is xxhash's 64-bit XXH3 of the shard's bytes, as hex. `documents`, when present,
has one entry per shard, in the same order. The shards read as one token sequence, in
manifest order; a document may run on from one shard into the next.

`write_token_shards` writes such a folder from arrays (one per document), streaming: only
the current array is in memory. `TokenShards` reads it back as a read-only 1-D sequence
over memory-mapped shards: `len()`, and `tokens[a:b]` across shard boundaries, which is a
lazy view (O(1) memory, as numpy's slices are); `np.asarray(view)` reads its tokens. So a
rank holds no more than the windows it asks for, whatever the corpus size.

Opening checks what is cheap every time (the manifest, each shard's presence and size,
the vocabulary against the model's tokenizer) and, once, what needs a read of every byte:
every id below vocab_size and every shard's xxh3, in one pass in bounded chunks. "Once":
with a `stamp_dir`, a passed scan leaves a stamp keyed by the manifest and the shards'
sizes and modification times, and later opens of the same unchanged folder skip the scan.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

FORMAT = "hybrid-token-shards/1"
MANIFEST = "manifest.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SCAN_BYTES = 4 << 20  # the scan's read buffer: its memory, whatever the corpus size


@dataclass(frozen=True)
class Shard:
    file: str
    n_tokens: int
    xxh3: str


def is_token_shards(folder: Path) -> bool:
    """True when `folder` is (meant to be) a token-shard folder: it holds a manifest.json."""
    return (Path(folder) / MANIFEST).is_file()


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


class TokenShards:
    """A read-only 1-D token sequence over the memory-mapped shards of a token-shard folder.

    `tokenizer_size` (the model's tokenizer's number of ids), when given, must cover the
    manifest's vocab_size. `scan=False` skips the read of every byte (the caller vouches
    for the folder); with `stamp_dir`, a scan that passed is remembered there.
    """

    def __init__(
        self,
        folder: str | Path,
        tokenizer_size: int | None = None,
        scan: bool = True,
        stamp_dir: str | Path | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.manifest = _read_manifest(self.folder)
        self.dtype: np.dtype = DTYPES[self.manifest["dtype"]]
        self.vocab_size: int = self.manifest["vocab_size"]
        self.shards = [Shard(s["file"], s["n_tokens"], s["xxh3"]) for s in self.manifest["shards"]]
        manifest_path = self.folder / MANIFEST
        if tokenizer_size is not None and self.vocab_size > tokenizer_size:
            raise ValueError(
                f"{manifest_path}: vocab_size {self.vocab_size} exceeds the tokenizer's "
                f"{tokenizer_size} ids; set data.tokenizer to the one the shards were made with"
            )
        for shard in self.shards:
            path = self.folder / shard.file
            if not path.is_file():
                raise ValueError(f"{manifest_path} names shard {shard.file}, which is missing")
            expected = shard.n_tokens * self.dtype.itemsize
            if path.stat().st_size != expected:
                raise ValueError(
                    f"{path}: {path.stat().st_size} bytes, but the manifest says {shard.n_tokens} "
                    f"{self.manifest['dtype']} tokens ({expected} bytes); the shard is truncated "
                    "or not this one: re-write it"
                )
        self.starts = np.cumsum([0] + [s.n_tokens for s in self.shards], dtype=np.int64)
        if self.starts[-1] == 0:
            raise ValueError(f"{manifest_path} lists no tokens; it is an empty source")
        self._lo, self._hi = 0, int(self.starts[-1])
        self._maps: list[np.ndarray | None] = [None] * len(self.shards)
        if scan:
            self.scan(stamp_dir)

    def scan(self, stamp_dir: str | Path | None = None) -> None:
        """Check every id and every shard's hash (ValueError, one line, on the first bad
        one); with `stamp_dir`, skipped when a scan of the unchanged folder passed before,
        and remembered there when this one passes."""
        stamp = self._stamp_path(Path(stamp_dir)) if stamp_dir is not None else None
        if stamp is None or not stamp.is_file():
            self._scan()
            if stamp is not None:
                stamp.parent.mkdir(parents=True, exist_ok=True)
                stamp.write_text(str(self.folder / MANIFEST) + "\n")

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("TokenShards supports contiguous slices only (step 1)")
            view = object.__new__(TokenShards)
            view.__dict__.update(self.__dict__)
            view._lo, view._hi = self._lo + start, self._lo + max(start, stop)
            return view
        position = int(index) + (len(self) if int(index) < 0 else 0)
        if not 0 <= position < len(self):
            raise IndexError(f"token {index} is outside a sequence of {len(self)}")
        return self.read(position, position + 1)[0]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        tokens = self.read(0, len(self))  # may be a view of a mapped shard
        tokens = tokens if dtype is None else tokens.astype(dtype, copy=False)
        return tokens.copy() if copy else tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this sequence, as an array (one copy when they cross a
        shard boundary, else a view of the mapped shard)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) are outside a sequence of {len(self)}")
        lo, hi = self._lo + start, self._lo + stop
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        pieces = []
        for i in range(max(first, 0), len(self.shards)):
            begin, end = int(self.starts[i]), int(self.starts[i + 1])
            if hi <= begin or lo >= hi:
                break
            if begin < end:  # an empty shard file cannot be mapped
                pieces.append(self._map(i)[max(lo, begin) - begin : min(hi, end) - begin])
        if not pieces:
            return np.zeros(0, self.dtype)
        return pieces[0].view(np.ndarray) if len(pieces) == 1 else np.concatenate(pieces)

    def tolist(self) -> list[int]:
        return self.read(0, len(self)).tolist()

    def document_starts(self) -> np.ndarray:
        """The global token offsets where documents begin (the whole folder's, not a view's);
        empty when the manifest has no document index. O(documents) memory."""
        per_shard = []
        for i, entry in enumerate(self.manifest.get("documents") or []):
            starts = np.fromfile(self.folder / entry["file"], dtype="<u8")
            per_shard.append(starts.astype(np.int64) + self.starts[i])
        return np.concatenate(per_shard) if per_shard else np.zeros(0, np.int64)

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies its data; send the folder and re-map on the other side.
        return {**self.__dict__, "_maps": [None] * len(self.shards)}

    def _map(self, i: int) -> np.ndarray:
        if self._maps[i] is None:
            self._maps[i] = np.memmap(
                self.folder / self.shards[i].file,
                dtype=self.dtype, mode="r", shape=(self.shards[i].n_tokens,),
            )  # fmt: skip
        return self._maps[i]

    def _scan(self) -> None:
        """Every id below vocab_size and every shard's xxh3 as recorded, read once through
        a fixed buffer (not the memmap, whose pages would stay in this process's RSS)."""
        buffer = np.empty(SCAN_BYTES // self.dtype.itemsize, dtype=self.dtype)
        for shard in self.shards:
            path, digest, offset = self.folder / shard.file, xxhash.xxh3_64(), 0
            with open(path, "rb") as f:
                while n_bytes := f.readinto(memoryview(buffer).cast("B")):
                    chunk = buffer[: n_bytes // self.dtype.itemsize]
                    digest.update(memoryview(chunk).cast("B"))
                    if chunk.size and int(chunk.max()) >= self.vocab_size:
                        at = int(np.argmax(chunk >= self.vocab_size))
                        raise ValueError(
                            f"{path}: token id {int(chunk[at])} at offset {offset + at} is outside "
                            f"the vocabulary [0, {self.vocab_size}) of {self.folder / MANIFEST}; "
                            "re-tokenize the shard or fix vocab_size"
                        )
                    offset += chunk.size
            if digest.hexdigest() != shard.xxh3:
                raise ValueError(
                    f"{path} does not match its xxh3 in {self.folder / MANIFEST} "
                    "(corrupt or changed since it was written); re-write it"
                )

    def _stamp_path(self, stamp_dir: Path) -> Path:
        key = hashlib.sha256((self.folder / MANIFEST).read_bytes())
        key.update(str(self.folder.resolve()).encode())
        for shard in self.shards:
            stat = (self.folder / shard.file).stat()
            key.update(f"|{shard.file}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        return stamp_dir / "shard-scans" / key.hexdigest()[:24]


def _read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, checked for our format and its fields; one-line ValueError if not."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(
            f"{folder}: no {MANIFEST}; a token-shard folder needs one (see launch/data/shards.py)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is unreadable ({error}); re-write it with write_token_shards"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(
            f"{path}: format is {found!r}, not {FORMAT!r}; not a hybrid token-shard manifest"
        )
    problem = None
    if manifest.get("dtype") not in DTYPES:
        problem = f"dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    elif not isinstance(manifest.get("vocab_size"), int) or manifest["vocab_size"] < 1:
        problem = f"vocab_size {manifest.get('vocab_size')!r} is not a positive integer"
    elif not isinstance(manifest.get("shards"), list):
        problem = "'shards' is not a list"
    else:
        for i, shard in enumerate(manifest["shards"]):
            if not (
                isinstance(shard, dict)
                and {"file", "n_tokens", "xxh3"} <= set(shard)
                and isinstance(shard["file"], str)
                and isinstance(shard["n_tokens"], int)
                and shard["n_tokens"] >= 0
            ):
                problem = f"shard {i} is not {{file, n_tokens >= 0, xxh3}}: {shard!r}"
                break
        documents = manifest.get("documents")
        if problem is None and documents is not None and len(documents) != len(manifest["shards"]):
            problem = (
                f"'documents' has {len(documents)} entries for {len(manifest['shards'])} shards"
            )
    if problem:
        raise ValueError(f"{path} is unreadable: {problem}; re-write it with write_token_shards")
    return manifest
