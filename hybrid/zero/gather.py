"""ZeRO stage 3: parameters live as DP shards and are gathered only while in use.

Each bucket's parameters are all-gathered into one flat buffer just before the bucket's
module runs forward, and again before it runs backward (where full recomputation also
runs its forward), and are freed right after each (ZeRO section 5.3: 3 Psi of traffic per
step with the reduce-scatter of gradients). The next bucket's gather is issued
asynchronously as soon as the current one is in use (prefetch), so the collective runs
while the current bucket computes: forward walks the buckets first to last, backward last
to first.

Freeing swaps a parameter's `.data` for an empty tensor; gathering swaps the full view
back. Autograd's saved references are to the parameter objects, so backward sees the
regathered values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import Group, Handle
from .bucket import FlatBucket


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
        self.dtype, self.device = dtype, device
        self._full: dict[int, torch.Tensor] = {}  # bucket index -> gathered flat buffer
        self._inflight: dict[int, tuple[Handle, torch.Tensor]] = {}
        for index in range(len(buckets)):
            self.free(index)

    def hook(self, model: nn.Module, units: list[nn.Module]) -> None:
        """Gather before forward and before backward, free after each; prefetch the next
        bucket in the direction of travel (bucket 0 is the model's own, 1.. the units)."""
        last = len(units)

        def before(index: int, following: int) -> None:
            self.gather(index)
            self.prefetch(following)

        def after_forward(index: int, output: Any, backward_next: int) -> None:
            self.free(index)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: (before(index, backward_next), grad)[1])

        model.register_forward_pre_hook(lambda m, a: before(0, 1 if units else -1))
        model.register_forward_hook(lambda m, a, out: after_forward(0, out, last))
        for index, unit in enumerate(units, start=1):
            backward_next = index - 1 if index > 1 else -1  # bucket 0 is already held
            unit.register_forward_pre_hook(lambda m, a, i=index: before(i, i + 1))
            unit.register_forward_hook(
                lambda m, a, out, i=index, n=backward_next: after_forward(i, out, n)
            )

    def prefetch(self, index: int) -> None:
        """Start gathering bucket `index` (no-op if out of range, gathered or under way)."""
        if not 0 <= index < len(self.buckets) or index in self._full or index in self._inflight:
            return
        full = torch.empty(self.buckets[index].numel, dtype=self.dtype, device=self.device)
        self._inflight[index] = (self.group.all_gather_into(full, self.shards[index]), full)

    def gather(self, index: int) -> None:
        """Make bucket `index`'s full parameters usable now."""
        if index in self._full:
            return
        self.prefetch(index)
        handle, full = self._inflight.pop(index)
        handle.wait()
        bucket = self.buckets[index]
        for p, view in zip(bucket.params, bucket.views(full), strict=True):
            p.data = view
        self._full[index] = full

    def free(self, index: int) -> None:
        for p in self.buckets[index].params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self._full.pop(index, None)

    def check_idle(self) -> None:
        """Between steps nothing may stay gathered or in flight: a gather issued before the
        optimizer step would deliver stale parameters after it."""
        if self._full or self._inflight:
            busy = sorted(set(self._full) | set(self._inflight))
            raise RuntimeError(f"ZeRO-3 buckets {busy} are still gathered at the optimizer step")

    def held_bytes(self) -> int:
        """Bytes of gathered (and in-flight) full buffers right now."""
        tensors = list(self._full.values()) + [full for _, full in self._inflight.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
