"""ZeRO stages 1-2: the updated parameters all-gathered after the step, overlapping the
next forward (Megatron's overlap-param-gather).

After the optimizer steps on this rank's shard, every bucket's full parameters must be
gathered over DP before a forward reads them. Waiting for all of them in the step leaves
the gathers exposed; here each bucket's gather is waited for in a forward pre-hook, just
before the first module that reads it runs (bucket 0, the model's own parameters, before
the model; bucket k before the first unit it holds), so the later buckets' gathers run
while the earlier ones compute.

At most `window` (2) gathers are in flight, issued in forward order (bucket 0 first):
gloo's own all-gather stages each gather's output in a buffer of its own until it is
waited for, so issuing every bucket at once would hold a second copy of all the
parameters (measured: +0.3 GB of peak RSS on an 85M-parameter fp32 rank); waiting for one
issues the next. (The pairwise exchange hybrid.distributed.comm runs on gloo, like NCCL's in-place
all-gather, writes into the flat buffer itself: there the window only bounds the
messages in flight.)
Every rank issues and waits in the same order (the module order of forward), so the
collectives' order is deterministic, and the values gathered are those the step wrote:
the losses are the same bit for bit as when every gather is waited for in the step.

Anything that reads the parameters other than through forward, or writes the shards a
gather reads (the next step; in fp32 the master is the shard; a checkpoint load), calls
`wait_all` first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hybrid.distributed.comm import Group, Handle


class ParameterPublisher:
    def __init__(
        self,
        flats: Sequence[torch.Tensor],
        shards: Sequence[torch.Tensor],
        group: Group,
        window: int = 2,
    ) -> None:
        self.flats, self.shards, self.group, self.window = list(flats), list(shards), group, window
        self._queued: list[int] = []  # buckets not yet issued, in forward order
        self._in_flight: dict[int, Handle] = {}  # issued, oldest first

    def start(self) -> None:
        """Begin gathering every bucket (the shards hold the new parameters)."""
        self.wait_all()
        self._queued = list(range(len(self.flats)))
        self._issue()

    def _issue(self) -> None:
        while self._queued and len(self._in_flight) < self.window:
            k = self._queued.pop(0)
            # In place: the shard is this rank's slice of the output, where the gather puts
            # it anyway (NCCL documents this case; gloo's own copies it onto itself, the
            # pairwise exchange leaves it).
            self._in_flight[k] = self.group.all_gather_into(self.flats[k], self.shards[k])

    def wait_for(self, bucket: int) -> None:
        """Make bucket `bucket`'s parameters readable: wait for the gathers issued before
        it and for its own, oldest first, issuing the next ones as others end."""
        while bucket in self._in_flight or bucket in self._queued:
            self._issue()
            oldest = next(iter(self._in_flight))
            self._in_flight.pop(oldest).wait()
        self._issue()

    def wait_all(self) -> None:
        """Every bucket's parameters readable, nothing in flight."""
        if self._queued or self._in_flight:
            self.wait_for(max([*self._queued, *self._in_flight]))

    def pending(self) -> list[int]:
        """Buckets whose gather has not been waited for (issued or not), in order."""
        return [*self._in_flight, *self._queued]

    def hook(self, model: nn.Module, units: Sequence[nn.Module], bucket_of: Callable) -> None:
        """Wait for bucket 0 before the model's forward and for each unit's bucket before
        the unit's; `bucket_of(unit)` is the bucket holding the unit's parameters. The
        hooks hold the publisher weakly (a module's hooks outlive engines)."""
        publisher = weakref.ref(self)

        def before(bucket: int) -> None:
            alive = publisher()
            if alive is not None:
                alive.wait_for(bucket)

        model.register_forward_pre_hook(lambda module, args: before(0))
        for unit in units:
            bucket = bucket_of(unit)
            unit.register_forward_pre_hook(lambda module, args, k=bucket: before(k))
