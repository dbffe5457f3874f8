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

from collections.abc import Callable
from typing import Any

import torch

from hybrid.distributed.comm import Group

Op = Callable[[torch.Tensor, Group], torch.Tensor]


class _Conjugate(torch.autograd.Function):
    """`forward_op` on the way in, `backward_op` on the gradient on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, forward_op: Op, backward_op: Op) -> Any:
        ctx.group, ctx.backward_op = group, backward_op
        out = forward_op(x, group)
        if out is x:  # reduced in place: autograd checks that nothing saved x before
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.backward_op(grad, ctx.group), None, None, None


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """In place, as Megatron-LM does: no copy of every activation. Forward, g's input is a
    row-parallel matmul's output, which nothing saved (marked dirty, so autograd would
    catch it if something did). Backward, f's gradient comes from its one consumer, a
    column-parallel matmul, fresh and held by nobody else. (A leaf that requires grad, as
    in a direct test of the operator, cannot change in place: it is copied.)"""
    if x.is_leaf and x.requires_grad:
        x = x.clone()
    return group.all_reduce(x)


def _conjugate(x: torch.Tensor, group: Group, forward_op: Op, backward_op: Op) -> torch.Tensor:
    return x if group.size == 1 else _Conjugate.apply(x, group, forward_op, backward_op)


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _conjugate(x, group, _identity, _all_reduce)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _conjugate(x, group, _all_reduce, _identity)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dim forward; this rank's slice of the gradient backward."""
    return _conjugate(x, group, lambda t, g: g.all_gather(t, -1), lambda t, g: g.split(t, -1))


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's chunk of the sequence forward; all-gather the gradient backward."""
    return _conjugate(x, group, lambda t, g: g.split(t, 0), lambda t, g: g.all_gather(t, 0))


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """SP's f: all-gather the sequence forward, reduce-scatter the gradient backward."""
    return _conjugate(
        x, group, lambda t, g: g.all_gather(t, 0), lambda t, g: g.reduce_scatter(t, 0)
    )


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """SP's g: reduce-scatter along the sequence forward, all-gather the gradient backward."""
    return _conjugate(
        x, group, lambda t, g: g.reduce_scatter(t, 0), lambda t, g: g.all_gather(t, 0)
    )
