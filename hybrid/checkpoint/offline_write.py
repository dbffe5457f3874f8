"""A DCP checkpoint written piece by piece from a function that produces each piece,
without the tensors ever being together in memory (one process, no process group).

    write_checkpoint_tensors(folder, [("model.wte.weight", (50257, 768), torch.float32)],
                             produce=lambda key, start, end: rows [start, end) of it)

Each tensor is stored as chunks of whole rows of at most `chunk_bytes` (a ChunkedTensor of
meta pieces: hybrid.checkpoint.chunks), so neither this writer nor a reader ever holds
more than one chunk of a tensor it does not keep: a rank loading its 1/8 of a 70B
model's 4 GB embedding reads the chunks that overlap its share, not the whole tensor.

DCP plans the save from shapes and dtypes alone; the planner's `resolve_data`, which the
writer (hybrid.checkpoint.raw.RawWriter) calls for one item at a time right before
writing it, produces the piece, and the writer holds no reference to it once written:
each piece's storage is released as soon as the next one is asked for.

The result is a checkpoint in DCP's layout that any layout loads, since DCP copies the
overlapping part of each chunk into whatever a rank holds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItem

from hybrid.checkpoint.chunks import ChunkedTensor, ChunkSavePlanner
from hybrid.checkpoint.raw import RawWriter

TensorLayout = list[tuple[str, tuple[int, ...], torch.dtype]]
Produce = Callable[[str, int, int], torch.Tensor]
CHUNK_BYTES = 64 << 20


class _ProducingPlanner(ChunkSavePlanner):
    """Produces each piece when the writer asks for it and frees the previous one."""

    def __init__(self, produce: Produce, layout: TensorLayout) -> None:
        super().__init__(flatten_state_dict=False, dedup_save_to_lowest_rank=False)
        self.produce = produce
        self.dtypes = {key: dtype for key, _, dtype in layout}
        self.previous: torch.Tensor | None = None
        self.produced: list[tuple[str, int]] = []

    def resolve_data(self, write_item: WriteItem) -> Any:
        self.release()
        key, start = write_item.index.fqn, write_item.index.offset[0]
        sizes = tuple(write_item.tensor_data.chunk.sizes)
        tensor = self.produce(key, start, start + sizes[0])
        got, want = (tuple(tensor.shape), tensor.dtype), (sizes, self.dtypes[key])
        if got != want:
            raise ValueError(f"{key}[{start}:]: produced {got}, the layout says {want}")
        self.previous = tensor
        self.produced.append((key, start))
        return tensor

    def release(self) -> None:
        """Drop the tensor handed out last (it has been written, and RawWriter keeps no
        reference to it): its storage is freed here."""
        self.previous = None


def row_chunks(shape: tuple[int, ...], dtype: torch.dtype, chunk_bytes: int) -> list[int]:
    """The first rows of the chunks a tensor is stored in: whole rows (elements of a 1-D
    tensor), at most `chunk_bytes` a chunk unless one row is larger."""
    row = torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size()
    step = max(1, chunk_bytes // max(row, 1))
    return list(range(0, shape[0], step)) if shape[0] else [0]


def write_checkpoint_tensors(
    directory: str | Path, layout: TensorLayout, produce: Produce, chunk_bytes: int | None = None
) -> list[tuple[str, int]]:
    """Write `layout`'s tensors (key, full shape, dtype) into `directory` as a DCP
    checkpoint, each as chunks of rows; `produce(key, start, end)` makes rows [start, end)
    of a tensor just before they are written. It must return a tensor no one else uses:
    its memory is freed once written. Returns (key, first row) of each chunk, in the order
    they were produced. `chunk_bytes` defaults to CHUNK_BYTES (read when called)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    state: dict[str, Any] = {}
    for key, shape, dtype in layout:
        if not shape:
            raise ValueError(f"{key}: a checkpoint tensor needs at least one dimension")
        starts = row_chunks(tuple(shape), dtype, chunk_bytes)
        pieces = []
        for a, b in zip(starts, [*starts[1:], shape[0]], strict=True):
            offsets = (a, *[0] * (len(shape) - 1))
            pieces.append((offsets, torch.empty((b - a, *shape[1:]), dtype=dtype, device="meta")))
        state[key] = ChunkedTensor(tuple(shape), pieces)
    planner = _ProducingPlanner(produce, layout)
    writer = RawWriter(str(directory))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    finally:
        planner.release()
    missing = sorted(state.keys() - {key for key, _ in planner.produced})
    if missing:
        raise ValueError(f"{directory}: tensors never written: {missing[:5]}")
    return planner.produced
