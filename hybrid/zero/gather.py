"""ZeRO stage 3: parameters live as DP shards and are gathered only while in use.

Each bucket's parameters are all-gathered into one flat buffer just before the bucket's
module runs forward, and again before it runs backward (where full recomputation also
runs its forward), and are freed right after each (ZeRO section 5.3: 3 Psi of traffic per
step with the reduce-scatter of gradients). The next bucket's gather is issued
asynchronously as soon as the current one is in use (prefetch), so the collective runs
while the current bucket computes: forward walks the buckets first to last, backward last
to first.

Note (the invariant that makes stage 3 hold only a few buckets): each bucket has one flat
buffer for its whole life, and every parameter's `.data` is a view into it, set once.
Freeing releases the buffer's *storage* (resized to 0 bytes); gathering reallocates it
and writes the shards into it. Autograd saves views of parameters (`F.linear` saves
`weight.t()`), and a view shares its base's storage, so once a bucket is freed no saved
tensor anywhere keeps its memory alive, and the regather before backward makes every
saved view valid again (FSDP frees its flat parameters the same way). Swapping `p.data`
instead would release the parameter but not the views autograd saved: the whole model
would stay alive from forward to backward. A freed bucket's parameters keep their shapes
but must not be read until gathered.

The all-gather writes into memory that saved views point at; the write is the restore of
the values they were saved with, so the version counter that guards saved tensors against
in-place changes is kept as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid.distributed.comm import Group, Handle
from hybrid.zero.bucket import FlatBucket


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


def tree_leaves(output: Any) -> list[Any]:
    """The leaves of a module's output: tensors in tuples, lists and mappings (a Hugging
    Face ModelOutput is a mapping)."""
    if isinstance(output, (tuple, list)):
        return [leaf for item in output for leaf in tree_leaves(item)]
    if isinstance(output, dict):
        return [leaf for item in output.values() for leaf in tree_leaves(item)]
    return [output]


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes the tensor's storage holds now (0 once freed)."""
    return tensor.untyped_storage().nbytes()


class ParameterGatherer:
    def __init__(
        self,
        buckets: list[FlatBucket],
        shards: list[torch.Tensor],
        group: Group,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.buckets, self.shards, self.group = buckets, shards, group
        # One flat buffer per bucket, for good; allocated and released one at a time here,
        # so the full model never exists on this rank.
        self._flat: list[torch.Tensor] = []
        for bucket in buckets:
            flat = torch.empty(bucket.numel, dtype=dtype, device=device)
            for p, view in zip(bucket.params, bucket.views(flat), strict=True):
                p.data = view
            flat.untyped_storage().resize_(0)
            self._flat.append(flat)
        self._held: set[int] = set()  # bucket indices whose storage is allocated
        self._inflight: dict[int, Handle] = {}

    def hook(self, model: nn.Module, units: list[nn.Module]) -> None:
        """Gather before forward and before backward, free after each; prefetch the next
        bucket in the direction of travel (bucket 0 is the model's own, 1.. the units)."""
        last = len(units)

        def before(index: int, following: int) -> None:
            self.gather(index)
            self.prefetch(following)

        def before_forward(index: int, following: int) -> None:
            # Inside backward this forward is a recomputation (see after_forward): the
            # gradient hook that started the bucket's backward gathered it and prefetches
            # in backward's direction, so nothing is prefetched forward from here.
            if in_backward():
                self.gather(index)
            else:
                before(index, following)

        def after_forward(index: int, output: Any, backward_next: int) -> None:
            # A unit's forward run again inside backward (a model's own checkpointing, e.g.
            # Hugging Face's gradient_checkpointing_enable, re-enters the module's hooks) is
            # recomputation: its backward reads the parameters next, so they stay gathered
            # (freed here, the output's hook below would gather them again: a wasted
            # all-gather per layer; torch's non-reentrant checkpoint stops before this).
            if in_backward():
                return
            self.free(index)
            # Any output tensor's gradient marks the start of this bucket's backward (a
            # model may return a tuple or a dict of them, e.g. Hugging Face's outputs).
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: (before(index, backward_next), grad)[1])

        model.register_forward_pre_hook(lambda m, a: before_forward(0, 1 if units else -1))
        model.register_forward_hook(lambda m, a, out: after_forward(0, out, last))
        for index, unit in enumerate(units, start=1):
            backward_next = index - 1 if index > 1 else -1  # bucket 0 is already held
            unit.register_forward_pre_hook(lambda m, a, i=index: before_forward(i, i + 1))
            unit.register_forward_hook(
                lambda m, a, out, i=index, n=backward_next: after_forward(i, out, n)
            )

    def prefetch(self, index: int) -> None:
        """Start gathering bucket `index` (no-op if out of range, gathered or under way)."""
        if not 0 <= index < len(self.buckets) or index in self._held:
            return
        flat = self._flat[index]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        self._held.add(index)
        with torch.autograd._unsafe_preserve_version_counter(flat):
            # Forward: gloo's own all-gather, waited for a unit later on forward's critical
            # path, where the pairwise exchange measured slower (hybrid.distributed.comm).
            # Backward: the pairwise exchange, which receives straight into the buffer
            # where gloo's stages a copy of it (a whole bucket more at backward's peak),
            # and has a unit's backward, twice its forward, to run in.
            self._inflight[index] = self.group.all_gather_into(
                flat, self.shards[index], gloo_own=not in_backward()
            )

    def gather(self, index: int) -> None:
        """Make bucket `index`'s full parameters usable now."""
        self.prefetch(index)
        handle = self._inflight.pop(index, None)
        if handle is not None:
            handle.wait()

    def free(self, index: int) -> None:
        """Release bucket `index`'s full buffer (its parameters' views stay, unreadable)."""
        handle = self._inflight.pop(index, None)
        if handle is not None:  # never read, but the collective must end before the free
            handle.wait()
        self._flat[index].untyped_storage().resize_(0)
        self._held.discard(index)

    def check_idle(self) -> None:
        """Between steps nothing may stay gathered or in flight: a gather issued before the
        optimizer step would deliver stale parameters after it."""
        if self._held:
            raise RuntimeError(
                f"ZeRO-3 buckets {sorted(self._held)} are still gathered at the optimizer step"
            )

    def held_bytes(self) -> int:
        """Bytes of gathered (and in-flight) full buffers right now, read from their
        storages."""
        return sum(storage_bytes(flat) for flat in self._flat)
