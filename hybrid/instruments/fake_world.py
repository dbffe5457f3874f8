"""One process playing one rank of a large job: torch's fake process group.

    with fake_world(world_size=256, rank=255):
        topology = Topology.build(tp=4)  # a (64, 4) DeviceMesh, groups and all

Every collective returns at once with the shapes the real job would see (torch 2.13's
FakeProcessGroup fills an all-gather's output with copies of this rank's input and a
reduce-scatter's with its slice of the input; an all-reduce leaves the tensor as it is),
while this rank's shards, kernels and memory are real. So a laptop or one GPU measures
what one rank of a 256-GPU job holds and computes (launch.rehearse), not an estimate of
it. Values are those of a job whose ranks all hold the same data: finite and of the
right scale, which is all the kernels' speed and the memory depend on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """The default process group of a world of `world_size` ranks, as rank `rank`, with
    no other process behind it; destroyed on exit."""
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} is outside a world of {world_size} ranks (0..{world_size - 1})"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "a process group already exists; a fake world needs a process of its own"
        )
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
