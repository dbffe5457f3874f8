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

`write_token_shards` (launch.data.shard_writer, re-exported here) writes such a folder
from arrays (one per document), streaming: only the current array is in memory; the
format's names and the manifest's check are launch.data.shard_format's. `TokenShards`
reads it back as a read-only 1-D sequence over memory-mapped shards: `len()`, and
`tokens[a:b]` across shard boundaries, which is a lazy view (O(1) memory, as numpy's
slices are); `np.asarray(view)` reads its tokens. So a rank holds no more than the
windows it asks for, whatever the corpus size.

Opening checks what is cheap every time (the manifest, each shard's presence and size,
the vocabulary against the model's tokenizer) and, once, what needs a read of every byte:
every id below vocab_size and every shard's xxh3, in one pass in bounded chunks. "Once":
with a `stamp_dir`, a passed scan leaves a stamp keyed by the manifest and the shards'
sizes and modification times, and later opens of the same unchanged folder skip the scan.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from launch.data.shard_format import DTYPES, MANIFEST, Shard, _read_manifest
from launch.data.shard_writer import write_token_shards

SCAN_BYTES = 4 << 20  # the scan's read buffer: its memory, whatever the corpus size


def is_token_shards(folder: Path) -> bool:
    """True when `folder` is (meant to be) a token-shard folder: it holds a manifest.json."""
    return (Path(folder) / MANIFEST).is_file()


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


__all__ = ["TokenShards", "is_token_shards", "write_token_shards"]
