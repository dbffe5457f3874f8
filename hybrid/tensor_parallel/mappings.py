"""Conjugate autograd operators between replicated, split and sequence-split regions.

Megatron-LM (Shoeybi et al. 2019, section 3) pairs an operator f (identity forward,
all-reduce backward) before a column-parallel layer with g (all-reduce forward, identity
backward) after a row-parallel one: two all-reduces forward and two backward per
transformer layer. Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) replaces
g by a reduce-scatter along the sequence and f by an all-gather, whose backward passes are
each other. The sequence is dim 0 of every activation ((s, b, h) layout), so each
collective works on contiguous memory.

Every operator returns its input unchanged when the group has one rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Group


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce(grad.clone()), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return group.all_reduce(x.clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.split(grad, dim=-1), None


class _ScatterToSequence(torch.autograd.Function):
    """Keep this rank's chunk of the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.split(x, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad, dim=0), None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather the sequence forward; reduce-scatter the gradient backward (SP's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.reduce_scatter(grad, dim=0), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient backward (SP's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad, dim=0), None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, group)
