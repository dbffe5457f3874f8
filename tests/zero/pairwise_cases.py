"""What test_pairwise.py runs on every rank of a gloo job (hybrid.distributed.pairwise)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybrid.distributed import pairwise
from hybrid.distributed.comm import CollectiveCounter, Group
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.instruments.dispatch_counters import CollectiveTrace

SHARD = 3001  # elements per rank: odd, so no piece lines up with a power of two


def inputs(rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s flat tensor, of size x SHARD elements, values of many magnitudes."""
    g = torch.Generator().manual_seed(17 + rank)
    return torch.randn(size * SHARD, generator=g) * torch.logspace(-3, 3, size * SHARD)


def exchanges() -> dict[str, Any]:
    env = init_distributed()
    try:
        world, rank = dist.group.WORLD, dist.get_rank()
        size = dist.get_world_size()
        flat = inputs(rank, size)
        shard = flat[rank * SHARD : (rank + 1) * SHARD].clone()
        result: dict[str, Any] = {"rank": rank, "size": size, "shard": shard}

        # All-gather, out of place and in place (the shard a view of the output).
        apart = torch.full((size * SHARD,), float("nan"))
        pairwise.all_gather(apart, shard, world, tag=1).wait()
        inside = torch.full((size * SHARD,), float("nan"))
        inside[rank * SHARD : (rank + 1) * SHARD] = shard
        pairwise.all_gather(inside, inside[rank * SHARD : (rank + 1) * SHARD], world, 2).wait()
        result |= {"gathered": apart, "gathered_in_place": inside}

        counter = CollectiveCounter()
        group = Group("dp", world, counter)
        result["pairwise"] = group.pairwise
        trace = CollectiveTrace({world.group_name: "dp"})
        with trace:
            # Four exchanges in flight at once, waited for in reverse: none takes another's
            # messages. At 2 ranks the reduce-scatters are pairwise too.
            outs = [torch.empty(SHARD), torch.empty(SHARD)]
            gathers = [torch.empty(size * SHARD), torch.empty(size * SHARD)]
            twice = flat * 2
            handles = [
                group.reduce_scatter_into(outs[0], flat),
                group.all_gather_into(gathers[0], shard),
                group.reduce_scatter_into(outs[1], twice),
                group.all_gather_into(gathers[1], shard * 3),
            ]
            for handle in reversed(handles):
                handle.wait()
        result |= {
            "reduced": outs[0],
            "reduced_twice": outs[1],
            "gathers": gathers,
            "counter": dict(counter.bytes),
            "trace_calls": dict(trace.calls),
            "trace_sent": dict(trace.sent),
        }
        if size == 2:
            own = torch.empty(SHARD)
            dist.reduce_scatter_single(own, flat, group=world)
            result["gloo_reduced"] = own
            # In bf16 too (grad_reduce_dtype=bf16): one rounding of a + b either way.
            half = flat.bfloat16()
            mine, gloo_own = (
                torch.empty(SHARD, dtype=torch.bfloat16),
                torch.empty_like(own).bfloat16(),
            )
            pairwise.reduce_scatter(mine, half, world, 4).wait()
            dist.reduce_scatter_single(gloo_own, half, group=world)
            result["bf16_equal"] = torch.equal(mine, gloo_own)
        else:
            try:
                pairwise.reduce_scatter(torch.empty(SHARD), flat, world, 3)
            except ValueError as error:
                result["refused"] = str(error)
        return result
    finally:
        shutdown(env)


def dropped() -> dict[str, Any]:
    """Exchanges dropped in flight, never waited for (an engine discarded while its
    gathers are under way), then a barrier and one exchange more: the group carries on."""
    env = init_distributed()
    try:
        world, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
        group = Group("dp", world, CollectiveCounter())
        big = torch.full((1 << 22,), float(rank))  # 16 MiB: still in flight when dropped
        for _ in range(3):
            group.all_gather_into(torch.empty(size * big.numel()), big)
            if size == 2:
                group.reduce_scatter_into(torch.empty(big.numel() // 2), big)
        dist.barrier()
        shard = torch.full((SHARD,), float(rank + 1))
        gathered = torch.empty(size * SHARD)
        group.all_gather_into(gathered, shard).wait()
        return {"gathered": gathered}
    finally:
        shutdown(env)
