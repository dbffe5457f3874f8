"""The checkpoint writer (hybrid.checkpoint.raw.RawWriter), hashing each shard file
(xxh3, hybrid.checkpoint.layout.CHECKSUM) as it writes it.

A checkpoint records the checksum of every file it writes, so that resume can name an
altered one (hybrid.checkpoint.folders). Hashing the files after writing them read every
byte back and took about as long as the write itself; here the bytes are hashed on their
way to the file, in a thread of their own, so the hash runs while the write and its fsync
wait on the disk.

The hash thread reads the writer's buffers after `write` has returned. RawWriter hands
each piece over as a memoryview of the tensor's own memory; the view, queued for the
hash thread, keeps that memory alive until it is hashed, and the stream waits for the
hash before the file is synced and closed. Small buffers are copied and gathered. Should
that ever break, the recorded hash differs from the file and resume names the file as
altered: a false alarm, never a silent corruption.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from hybrid.checkpoint.layout import CHECKSUM
from hybrid.checkpoint.raw import RawWriter

COPY_BELOW = 1 << 16  # bytes: buffers this small are copied (and gathered) to be hashed


class _HashingStream(io.RawIOBase):
    """A binary file whose bytes are also fed, in order, to a checksum in another thread."""

    def __init__(self, raw: Any, executor: ThreadPoolExecutor) -> None:
        super().__init__()
        self.raw, self.executor = raw, executor
        self.checksum = xxhash.xxh3_128()
        self.last: Future | None = None
        self.small = bytearray()  # small writes, gathered: one hand-over per 64 KiB

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < COPY_BELOW:
            self.small += view
            if len(self.small) >= COPY_BELOW:
                self._hand_over_small()
        else:
            self._hand_over_small()
            self._hash(view)
        return self.raw.write(view)

    def _hand_over_small(self) -> None:
        if self.small:
            self._hash(memoryview(bytes(self.small)))
            self.small.clear()

    def _hash(self, view: memoryview) -> None:
        self.last = self.executor.submit(self.checksum.update, view)  # one thread: in order

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        self.digest()  # DCP syncs, then closes: the buffers are still alive here
        return self.raw.fileno()

    def digest(self) -> str:
        self._hand_over_small()
        if self.last is not None:
            self.last.result()
        return f"{CHECKSUM}:{self.checksum.hexdigest()}"


class _HashingFileSystem(FileSystem):
    def __init__(self, digests: dict[str, str]) -> None:
        super().__init__()
        self.digests = digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with ThreadPoolExecutor(1, "checkpoint-hash") as executor, Path(path).open("wb") as raw:
            stream = _HashingStream(raw, executor)
            yield stream
            self.digests[Path(path).name] = stream.digest()


class HashingWriter(RawWriter):
    """RawWriter that records the checksum of each shard file it writes in
    `digests` (file name -> "xxh3_128:<hex>"), without reading any file back."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.digests: dict[str, str] = {}
        self.fs = _HashingFileSystem(self.digests)
