"""A bucket: a group of parameters laid out in one flat, padded range and sharded along DP.

The flat range holds the parameters back to back and is padded to a multiple of dp, so
every DP rank owns an equal slice [rank * n/dp, (rank + 1) * n/dp) (reduce-scatter and
all-gather need equal shards). Adam is elementwise, so stepping on a slice of the flat
range equals stepping on the whole tensors it cuts through (ZeRO section 5.1).

Parameters are ordered by *kind* before they are laid out, so each kind is one contiguous
range and a rank's shard is at most one segment per kind:
- decay: weight decay applies (matrices) or not (biases, norms: dim < 2);
- split: the parameter is sliced across TP ranks, or replicated on every TP rank (counted
  once in the global gradient norm; its gradient summed over TP under sequence parallelism).
Padding, zero and gradient-free, joins the last segment.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybrid.tensor_parallel import parameter_shards


@dataclass(frozen=True)
class Kind:
    decay: bool
    split: bool


@dataclass(frozen=True)
class Segment:
    """Elements [start, end) of some flat range whose parameters are all of `kind`."""

    kind: Kind
    start: int
    end: int


class FlatBucket:
    """Layout only: which parameter sits where in the flat range and in this rank's shard.
    It holds no data, so it can be computed for any dp on meta parameters (planning)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        split_names: set[str],
        dp_size: int,
        dp_rank: int,
    ) -> None:
        def kind(item: tuple[str, nn.Parameter]) -> Kind:
            name, p = item
            return Kind(decay=p.dim() >= 2, split=name in split_names)

        ordered = sorted(named_params, key=lambda item: (not kind(item).decay, kind(item).split))
        self.names = [name for name, _ in ordered]
        self.params = [p for _, p in ordered]
        # Shapes and kinds are recorded now: at stage 3 the parameters become empty.
        self.shapes = [p.shape for p in self.params]
        self.kinds = [kind(item) for item in ordered]
        self._lay_out(dp_size, dp_rank)

    def relayout(self, dp_size: int, dp_rank: int) -> FlatBucket:
        """The same parameters in the same order, sharded for another dp (checkpoints)."""
        other = copy.copy(self)
        other._lay_out(dp_size, dp_rank)
        return other

    def _lay_out(self, dp_size: int, dp_rank: int) -> None:
        self.offsets: list[int] = []
        total = 0
        full_segments: list[Segment] = []
        for k, shape in zip(self.kinds, self.shapes, strict=True):
            self.offsets.append(total)
            n = shape.numel()
            if full_segments and full_segments[-1].kind == k:
                full_segments[-1] = Segment(k, full_segments[-1].start, total + n)
            else:
                full_segments.append(Segment(k, total, total + n))
            total += n
        self.numel = -(-total // dp_size) * dp_size  # padded: equal shards
        self.padding = self.numel - total
        self.shard_numel = self.numel // dp_size
        self.shard_start = dp_rank * self.shard_numel
        if full_segments and self.padding:
            last = full_segments[-1]
            full_segments[-1] = Segment(last.kind, last.start, self.numel)
        self.full_segments = full_segments
        # The same kinds, as ranges of this rank's shard.
        shard_end = self.shard_start + self.shard_numel
        self.segments = [
            Segment(
                s.kind,
                max(s.start, self.shard_start) - self.shard_start,
                min(s.end, shard_end) - self.shard_start,
            )
            for s in full_segments
            if max(s.start, self.shard_start) < min(s.end, shard_end)
        ]

    def parameter_segments(self) -> list[Segment]:
        """One segment per parameter, in order, over the unsharded flat range."""
        ends = [o + s.numel() for o, s in zip(self.offsets, self.shapes, strict=True)]
        return [Segment(k, o, e) for k, o, e in zip(self.kinds, self.offsets, ends, strict=True)]

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s view into a full flat tensor."""
        shape, offset = self.shapes[index], self.offsets[index]
        return flat[offset : offset + shape.numel()].view(shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.params))]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full flat tensor."""
        return flat[self.shard_start : self.shard_start + self.shard_numel]

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """(parameter index, start, end, offset): elements [start, end) of the flattened
        parameter sit at `offset` in this rank's shard."""
        out = []
        shard_end = self.shard_start + self.shard_numel
        for i, (shape, offset) in enumerate(zip(self.shapes, self.offsets, strict=True)):
            start, end = max(offset, self.shard_start), min(offset + shape.numel(), shard_end)
            if start < end:
                out.append((i, start - offset, end - offset, start - self.shard_start))
        return out


def max_bucket_numel(stage: int, bucket_mb: float, element_size: int) -> int | None:
    """The most elements consecutive units may share in one bucket: `bucket_mb` MiB at
    stages 0-2 (few, large collectives); None at stage 3, which gathers unit by unit."""
    return None if stage == 3 else int(bucket_mb * 2**20 / element_size)


def group_units(unit_numels: Sequence[int], max_numel: int | None) -> list[list[int]]:
    """Indices of the units in each unit bucket: one unit per bucket, or, with `max_numel`,
    consecutive units together while their total fits (a unit larger than the cap gets a
    bucket of its own). The engine lays out its buckets by this rule and the planner
    (hybrid.memory) predicts their padding by it, so both agree to the element."""
    groups: list[list[int]] = []
    size = 0
    for index, numel in enumerate(unit_numels):
        if max_numel is not None and groups and size + numel <= max_numel:
            groups[-1].append(index)
            size += numel
        else:
            groups.append([index])
            size = numel
    return groups


def build_buckets(
    model: nn.Module,
    units: list[nn.Module],
    dp_size: int,
    dp_rank: int,
    max_numel: int | None = None,
) -> list[FlatBucket]:
    """Bucket 0: the parameters outside every unit; then the units, one per bucket, or,
    with `max_numel`, consecutive units together while they fit. Works on meta
    parameters, so a layout can be planned for any dp without memory."""
    names = {id(p): name for name, p in model.named_parameters()}
    split = set(parameter_shards(model))
    # A parameter shared by two units (tied across blocks) joins bucket 0, held through
    # the whole forward and backward, so it is laid out (and stepped on) once.
    owners = Counter(id(p) for unit in units for p in unit.parameters())
    in_units = {key for key, count in owners.items() if count == 1}
    groups = [[(names[id(p)], p) for p in model.parameters() if id(p) not in in_units]]
    per_unit = [
        [(names[id(p)], p) for p in unit.parameters() if id(p) in in_units] for unit in units
    ]
    numels = [sum(p.numel() for _, p in params) for params in per_unit]
    for indices in group_units(numels, max_numel):
        groups.append([item for i in indices for item in per_unit[i]])
    return [FlatBucket(g, split, dp_size, dp_rank) for g in groups]
