"""A bucket: a group of parameters laid out in one flat, padded range and sharded along DP.

The flat range holds the parameters back to back and is padded to a multiple of dp, so
every DP rank owns an equal slice [rank * n/dp, (rank + 1) * n/dp) (reduce-scatter and
all-gather need equal shards). The optimizer state of a parameter lives with whichever
ranks own its elements: the intersection of the parameter's range with a rank's slice is a
*piece*, and Adam is elementwise, so stepping on pieces equals stepping on whole tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of `param` (flattened) that this rank owns, at `offset` in
    this rank's shard."""

    param: nn.Parameter
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class Bucket:
    def __init__(self, params: list[nn.Parameter], dp_size: int, dp_rank: int) -> None:
        self.params = params
        # Shapes are recorded now: at stage 3 the parameters themselves become empty.
        self.shapes = [p.shape for p in params]
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = -(-total // dp_size) * dp_size  # padded: equal shards
        self.padding = self.numel - total
        self.shard_numel = self.numel // dp_size
        shard_start = dp_rank * self.shard_numel
        self.pieces: list[Piece] = []
        for p, offset in zip(params, self.offsets, strict=True):
            start = max(offset, shard_start)
            end = min(offset + p.numel(), shard_start + self.shard_numel)
            if start < end:
                self.pieces.append(Piece(p, start - offset, end - offset, start - shard_start))

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One flat tensor of `numel` elements from per-parameter tensors (zero padding)."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        if self.padding:
            flat = torch.cat([flat, flat.new_zeros(self.padding)])
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into a full flat tensor."""
        return [
            flat[offset : offset + shape.numel()].view(shape)
            for shape, offset in zip(self.shapes, self.offsets, strict=True)
        ]
