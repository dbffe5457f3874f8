"""A global tensor of which this rank holds some rectangles, in the form DCP saves and loads.

ZeRO shards a flat bucket, so a rank owns a flat range of each parameter: up to three rectangles
of the tp=1 tensor, of different shapes, on no regular grid (hybrid.checkpoint.engine_state).
DTensor cannot describe that (its placements split a tensor evenly along dimensions), and
ShardedTensor, which can, is deprecated and checks every key with an object all-gather over the
whole world when it is built (one collective per key: 900 of them for a 24-layer model, more
than the write itself took). DCP instead lets any object describe its own pieces through the
hooks DTensor uses (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`);
`ChunkedTensor` implements them over views of the engine's tensors, so nothing is copied and no
collective runs until DCP's one plan exchange.

DCP's default planners look pieces up by `isinstance(obj, torch.Tensor)` only, so
`ChunkSavePlanner` and `ChunkLoadPlanner` route lookups of a ChunkedTensor to its hook
(and keep the load planner's set-up from replacing it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class ChunkedTensor:
    """A tensor of global shape `size` of which this rank holds `pieces`: (offsets, tensor)
    pairs, each tensor the rectangle at those offsets (a view DCP writes from or loads into).
    A rank may hold no piece of a key; every key still appears on every rank."""

    def __init__(self, size: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self._size = torch.Size(size)
        self.pieces = {torch.Size(offsets): tensor for offsets, tensor in pieces}

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self._size,
                ),
            )
            for offsets, tensor in self.pieces.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=offsets, sizes=tensor.size())
            for offsets, tensor in self.pieces.items()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset not in self.pieces:
            raise ValueError(f"{index.fqn}: this rank holds no piece at {tuple(index.offset)}")
        return self.pieces[index.offset]


def _lookup(state_dict: dict[str, Any], index: MetadataIndex, default: Any) -> Any:
    obj = state_dict.get(index.fqn)
    if isinstance(obj, ChunkedTensor):
        return obj.__get_tensor_shard__(index)
    return default(index)


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's save planner, finding a ChunkedTensor's pieces through its own hook."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index, super().lookup_object)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, copying into a ChunkedTensor's pieces through its own hook."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        # The default set-up replaces every value of a type it does not know with None
        # (it materialises meta tensors); ours are put back, at the top level where they are.
        chunked = {k: v for k, v in state_dict.items() if isinstance(v, ChunkedTensor)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunked)
        self.state_dict.update(chunked)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, super().lookup_tensor)
