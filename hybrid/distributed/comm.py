"""The collectives the library uses, each counted by kind and group.

`Group` wraps one process group (or none, for a group of one rank) with the few collectives
tensor and data parallelism need. Every call is recorded in a `CollectiveCounter` shared by
the groups of one topology, so tests and benchmarks compare what moved with theory.

Bytes counted per call (this rank's view, the convention of the ZeRO paper's volumes):
- all-reduce: the tensor's size;
- all-gather: the gathered (full) tensor's size;
- reduce-scatter: the input (full) tensor's size.
A group of one rank runs no collective and records nothing.

On gloo, the asynchronous all-gather of ZeRO's flat buffers, and their reduce-scatter in a group
of two, are direct exchanges between pairs of ranks (hybrid.distributed.pairwise): the same
bytes for a fraction of gloo's CPU time. They are counted as the collectives they implement."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybrid.distributed import pairwise


@dataclass
class CollectiveCounter:
    """calls and bytes per (kind, group name), e.g. ('all_reduce', 'tp')."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, group: str, nbytes: int) -> None:
        self.calls[kind, group] += 1
        self.bytes[kind, group] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of the call counts, to diff around a region of interest."""
        return dict(self.calls)


class Group:
    """One process group with counted collectives. `process_group=None` with size 1 means
    this rank alone: every collective is then the identity and costs nothing."""

    def __init__(
        self,
        name: str,
        process_group: dist.ProcessGroup | None,
        counter: CollectiveCounter,
    ) -> None:
        self.name = name
        self.process_group = process_group
        self.counter = counter
        self.size = 1 if process_group is None else dist.get_world_size(process_group)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        # gloo's own reduce-scatter and all-gather are slow on CPU (hybrid.distributed.pairwise).
        self.pairwise = process_group is not None and dist.get_backend(process_group) == "gloo"
        self._exchanges = 0  # numbers the pairwise exchanges alike on every rank

    @classmethod
    def single(cls, name: str, counter: CollectiveCounter | None = None) -> Group:
        return cls(name, None, counter or CollectiveCounter())

    @classmethod
    def whole_job(cls, counter: CollectiveCounter | None = None) -> Group:
        """Every rank of the job (the default process group), or this rank alone when
        there is none: for agreements of the whole job (preemption, resume checks)."""
        job = dist.is_initialized() and dist.get_world_size() > 1
        return cls("world", dist.group.WORLD if job else None, counter or CollectiveCounter())

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """In place; returns `tensor`."""
        if self.size > 1:
            self.counter.record("all_reduce", self.name, _nbytes(tensor))
            dist.all_reduce(tensor, op=op, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order."""
        if self.size == 1:
            return tensor
        tensor = tensor.movedim(dim, 0).contiguous() if dim != 0 else tensor.contiguous()
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        self.counter.record("all_gather", self.name, _nbytes(out))
        dist.all_gather_single(out, tensor, group=self.process_group)
        return out.movedim(0, dim) if dim != 0 else out

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/size slice along `dim`."""
        if self.size == 1:
            return tensor
        if tensor.shape[dim] % self.size:
            raise ValueError(
                f"reduce-scatter over {self.size} ranks needs dim {dim} of {tuple(tensor.shape)} "
                f"to be divisible by {self.size}"
            )
        tensor = tensor.movedim(dim, 0).contiguous() if dim != 0 else tensor.contiguous()
        out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        self.counter.record("reduce_scatter", self.name, _nbytes(tensor))
        dist.reduce_scatter_single(out, tensor, group=self.process_group)
        return out.movedim(0, dim) if dim != 0 else out

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: every rank gets group rank 0's `tensor`; returns it."""
        if self.size > 1:
            self.counter.record("broadcast", self.name, _nbytes(tensor))
            dist.broadcast(tensor, group=self.process_group, group_src=0)
        return tensor

    # ---- asynchronous, in place: for overlapping communication with compute (ZeRO) ----

    def all_reduce_async(self, tensor: torch.Tensor) -> Handle:
        """Start a SUM all-reduce of `tensor` in place; `wait()` the handle before use."""
        if self.size == 1:
            return Handle(None)
        self.counter.record("all_reduce", self.name, _nbytes(tensor))
        return Handle(dist.all_reduce(tensor, group=self.process_group, async_op=True))

    def all_gather_into(
        self, out: torch.Tensor, shard: torch.Tensor, gloo_own: bool = False
    ) -> Handle:
        """Start gathering every rank's flat `shard` into flat `out` (size x as long).
        `gloo_own=True` keeps gloo's own all-gather where the group would exchange pairwise:
        for gathers waited for just after they are issued (ZeRO-3's prefetch), where it
        measured faster: stage 3 with the pairwise all-gather took 1.21x stage 0's step,
        1.15x with gloo's own (benchmarks/speed/zero_speed.py, 7 paired rounds)."""
        if self.size == 1:
            out.copy_(shard)
            return Handle(None)
        self.counter.record("all_gather", self.name, _nbytes(out))
        if self.pairwise and not gloo_own:
            return Handle(pairwise.all_gather(out, shard, self.process_group, self._tag()))
        work = dist.all_gather_single(out, shard, group=self.process_group, async_op=True)
        return Handle(work)

    def reduce_scatter_into(self, out: torch.Tensor, flat: torch.Tensor) -> Handle:
        """Start summing flat `flat` over ranks into this rank's 1/size slice `out`."""
        if self.size == 1:
            out.copy_(flat)
            return Handle(None)
        self.counter.record("reduce_scatter", self.name, _nbytes(flat))
        if self.pairwise and pairwise.reduces_pairwise(self.size):
            return Handle(pairwise.reduce_scatter(out, flat, self.process_group, self._tag()))
        work = dist.reduce_scatter_single(out, flat, group=self.process_group, async_op=True)
        return Handle(work)

    def _tag(self) -> int:
        self._exchanges += 1
        return self._exchanges

    def split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size slice along `dim` (no communication)."""
        if self.size == 1:
            return tensor
        if tensor.shape[dim] % self.size:
            raise ValueError(
                f"cannot split dim {dim} of {tuple(tensor.shape)} over {self.size} ranks"
            )
        return tensor.chunk(self.size, dim=dim)[self.rank].contiguous()


class VirtualGroup(Group):
    """A group's size and rank with no processes behind it: for building a model on the
    meta device at a layout this job does not run (planning shard shapes and memory).
    Every collective refuses."""

    def __init__(self, name: str, size: int, rank: int) -> None:
        super().__init__(name, None, CollectiveCounter())
        self.size, self.rank = size, rank

    def _refuse(self, *args: object, **kwargs: object) -> Handle:
        raise RuntimeError(f"virtual group {self.name!r} (planning only) cannot communicate")

    all_reduce = all_gather = reduce_scatter = broadcast = _refuse  # type: ignore[assignment]
    all_reduce_async = all_gather_into = reduce_scatter_into = _refuse  # type: ignore[assignment]


class Handle:
    """An issued collective; `wait()` blocks until its result may be read."""

    def __init__(self, work: dist.Work | pairwise.PairwiseWork | None) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
