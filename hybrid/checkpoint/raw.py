"""Checkpoint pieces stored as their raw bytes, in DCP's layout of files and index.

DCP's FileSystemWriter wraps every piece in a `torch.save` zip of its own. Measured here
(benchmarks/checkpoint/checkpoint_speed.md) that alone made a save take 2.1-2.3x a raw write of
the same bytes: the zip's records, its headers and a Python pass over each storage, for
each of a save's thousands of pieces. A piece is already a dense tensor whose shape and
dtype the index records (its chunk's sizes, the tensor's properties), so the file needs
nothing but its bytes: `RawWriter` writes each piece's memory as it is, one file per rank
(`__<rank>_0.distcp`, as DCP names them), and marks the piece in the index with the
descriptor `RAW` where DCP records a stream transform. `RawReadMixin` reads such a piece
straight into the tensor it is loaded into when it can (`readinto`, no copy), or the rows
it needs into a buffer first; pieces without the mark (checkpoints written before, or by
DCP itself) go to DCP's own reader. DCP's FileSystemReader does not know the mark and
stops with "Unknown extension", instead of misreading the bytes.

Byte order is the machine's (little-endian on every platform torch builds for).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

RAW = "hybrid-raw/1"  # in _StorageInfo.transform_descriptors: the piece is its bytes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a dense CPU tensor, in C order: a view of its memory when it is
    contiguous, else of a contiguous copy (the view keeps either alive)."""
    flat = tensor.detach().reshape(-1)  # a view when contiguous, a copy otherwise
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class RawWriter(FileSystemWriter):
    """FileSystemWriter storing each tensor piece as its raw bytes (see the module
    docstring); objects (BYTE_IO items) are written as DCP writes them, their bytes."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _StoragePrefix = plan.storage_data
        name = f"{prefix.prefix}0.distcp"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO), item
                    view, marks = data.getbuffer(), None
                else:
                    data = data.detach().cpu()  # a no-op for the host tensors of a save
                    view, marks = tensor_bytes(data), [RAW]
                offset = stream.tell()
                stream.write(view)
                info = _StorageInfo(name, offset, view.nbytes, transform_descriptors=marks)
                results.append(WriteResult(item.index, view.nbytes, info))
                del data, view  # a produced piece is freed once written
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


class RawReadMixin:
    """For a FileSystemReader: pieces marked `RAW` are read here, the others by DCP."""

    path: Any
    fs: Any
    storage_data: dict[MetadataIndex, _StorageInfo]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:  # fmt: skip
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]
        self._pieces: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                for chunk in meta.chunks:
                    self._pieces[MetadataIndex(fqn, chunk.offsets)] = (
                        chunk.sizes,
                        meta.properties.dtype,
                    )

    def _is_raw(self, item: ReadItem) -> bool:
        marks: Sequence[str] | None = self.storage_data[item.storage_index].transform_descriptors
        return item.type == LoadItemType.TENSOR and bool(marks) and RAW in marks

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw, rest = [], []
        for item in plan.items:
            (raw if self._is_raw(item) else rest).append(item)
        by_file: dict[str, list[ReadItem]] = {}
        for item in raw:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in items:
                    self._read_piece(stream, item, planner)
        if rest:
            return super().read_data(LoadPlan(rest, plan.storage_data), planner)  # type: ignore[misc]
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_piece(self, stream: Any, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        index = item.storage_index
        sizes, dtype = self._pieces[MetadataIndex(index.fqn, index.offset)]
        element = torch.empty((), dtype=dtype).element_size()
        if info.length != sizes.numel() * element:
            raise ValueError(
                f"{info.relative_path}: piece of {item.storage_index.fqn} holds {info.length} "
                f"bytes, its shape {tuple(sizes)} of {dtype} needs {sizes.numel() * element}"
            )
        target = planner.resolve_tensor(item).detach()
        # Rows [first, first + count) of the piece when only dimension 0 is cut (always
        # so for ZeRO's flat pieces and row chunks): their bytes are contiguous in the file.
        starts, lengths = list(item.storage_offsets), list(item.lengths)
        rows_only = all(s == 0 for s in starts[1:]) and list(lengths[1:]) == list(sizes[1:])
        if len(sizes) == 0 or rows_only:
            first = starts[0] if sizes else 0
            row = sizes[1:].numel() * element if sizes else element
            direct = target.is_contiguous() and target.dtype == dtype and target.is_cpu
            buffer = target if direct else torch.empty(target.shape, dtype=dtype)
            stream.seek(info.offset + first * row)
            _read_exactly(stream, tensor_bytes(buffer), info.relative_path)
            if buffer is not target:
                target.copy_(buffer)
        else:
            whole = torch.empty(sizes, dtype=dtype)
            stream.seek(info.offset)
            _read_exactly(stream, tensor_bytes(whole), info.relative_path)
            for dim, (start, length) in enumerate(zip(starts, lengths, strict=True)):
                whole = whole.narrow(dim, start, length)
            target.copy_(whole)
        planner.commit_tensor(item, target)


def _read_exactly(stream: Any, view: memoryview, name: str) -> None:
    done = 0
    while done < view.nbytes:
        got = stream.readinto(view[done:])
        if not got:
            raise ValueError(f"{name} ends {view.nbytes - done} bytes early")
        done += got
