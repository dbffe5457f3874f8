"""Reduce-scatter and all-gather as direct exchanges between every pair of ranks, on
point-to-point sends: what `hybrid.distributed.comm.Group` uses for ZeRO's flat buffers on gloo.

Why: on CPU the cores that compute also run the collectives, so a collective's CPU time is
step time lost however well it overlaps. gloo's own reduce-scatter and all-gather cost
1.3-1.8x the CPU time of an all-reduce of the same tensor, though a ring all-reduce is a
reduce-scatter followed by an all-gather; the same exchanges on isend/irecv cost a fifth
to a third of gloo's (benchmarks/speed/zero_speed.md measures all three on the demo model's
parameters, 3.5 MB over 2 ranks). NCCL keeps its own collectives.

Bytes: a rank sends its piece of S/n to each of the n-1 others (all-gather), or in a group of
two the other's half to it (reduce-scatter): S (n-1)/n, a ring's share per rank (the ZeRO
paper's section 7 convention, which hybrid.distributed.comm and the planner count). A call posts
all its sends and receives at once, so nothing waits on a chain of steps and the whole exchange
runs while the caller computes; n-1 messages per rank suit the few ranks gloo runs on, not
hundreds.

Order: gloo pairs a pair of ranks' messages of one tag in the order they were posted, and
every rank issues a group's exchanges in the same order (the engine's bucket order), so
each receive meets its own send. The tags, numbered alike on every rank, keep these
messages apart from any other point-to-point traffic on the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TAGS = 1 << 30  # gloo tags are 32-bit; any fixed range that both sides number alike


def reduces_pairwise(size: int) -> bool:
    """Whether a group of `size` ranks reduce-scatters pairwise (`reduce_scatter`): two
    only. hybrid.distributed.comm routes by it, and the planner counts gloo's copy of the input
    (hybrid.memory.peak) where it is false."""
    return size == 2


class PairwiseWork:
    """The sends and receives of one exchange; `wait()` ends them and folds the result."""

    def __init__(
        self, works: list[dist.Work], fold: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        self.works, self.fold = works, fold  # fold: (out, what to add to it once received)

    def wait(self) -> None:
        self._finish()
        if self.fold is not None:
            out, addend = self.fold
            out.add_(addend)
            self.fold = None

    def __del__(self) -> None:
        # A send or receive freed in flight leaves gloo's transport spinning on a freed
        # buffer (measured: the next collective on any group hangs). An exchange dropped
        # un-waited (an engine discarded with gathers under way) is finished here; its
        # peers posted the matching halves when they issued the same exchange.
        self._finish()

    def _finish(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


def reduce_scatter(
    out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, tag: int
) -> PairwiseWork:
    """Start summing 1-D `flat` over a group of two into this rank's half `out`: the half the
    other rank owns is sent to it, the other rank's copy of this rank's half lands in `out`, and
    this rank's own half is added at `wait()` (b + a = a + b: the same bits as gloo's own).
    `flat` is read until `wait()`. More ranks would need n-2 pieces of receive space besides
    `out`, which the ZeRO accounting does not count: hybrid.distributed.comm keeps gloo's own
    reduce-scatter there."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if not reduces_pairwise(size):
        raise ValueError(f"the pairwise reduce-scatter is for 2 ranks, not {size}")
    pieces, peer = flat.view(2, -1), 1 - rank
    works = [
        dist.isend(pieces[peer], group=group, group_dst=peer, tag=tag % _TAGS),
        dist.irecv(out, group=group, group_src=peer, tag=tag % _TAGS),
    ]
    return PairwiseWork(works, (out, pieces[rank]))


def all_gather(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, tag: int
) -> PairwiseWork:
    """Start gathering every rank's 1-D `shard` into 1-D `out` (n times as long), in rank
    order; `shard` may be this rank's piece of `out`, and is read until `wait()`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = out.view(size, -1)
    mine = pieces[rank]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard)
    works = []
    for peer in (r for r in range(size) if r != rank):
        works.append(dist.isend(mine, group=group, group_dst=peer, tag=tag % _TAGS))
        works.append(dist.irecv(pieces[peer], group=group, group_src=peer, tag=tag % _TAGS))
    return PairwiseWork(works)
