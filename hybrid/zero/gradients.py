"""The step's gradients: this rank's reduced shards handed to the fp32 masters (unscaled),
then checked: fp16's overflow flag and the global L2 norm (for clipping and the NaN
check), each agreed by every rank.

Each element is counted once: DP shards are disjoint at stages 1-3 (at stage 0 every DP
rank holds the same full gradient, so no DP reduction), TP-split parameters are summed
over TP, and replicated ones (LayerNorms, biases of row-parallel layers) are counted once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from hybrid.distributed.comm import Group
from hybrid.zero.bucket import FlatBucket
from hybrid.zero.state import BucketState


def step_gradients(
    states: Sequence[BucketState],
    buckets: Sequence[FlatBucket],
    grad_dtype: torch.dtype,
    loss_scale: float,
    autograd: bool,
) -> list[torch.Tensor]:
    """The gradients the step uses, set as the master views' `.grad`: autograd's own when
    the engine keeps them (`autograd`: its optimizer is then per parameter), else the
    reduced shards."""
    if autograd:
        return autograd_gradients(states, buckets)
    return master_gradients(states, grad_dtype, loss_scale)


def master_gradients(
    states: Sequence[BucketState], grad_dtype: torch.dtype, loss_scale: float
) -> list[torch.Tensor]:
    """Each bucket's gradient shard in fp32 and unscaled, set as its master views' `.grad`
    (the optimizer steps on them); the shard is let go. A bucket nothing was reduced into
    has a zero gradient."""
    grads = []
    for state in states:
        grad = state.grad_shard
        if grad is None:  # nothing reduced into this bucket: zero gradient
            grad = torch.zeros_like(state.master, dtype=grad_dtype)
        if grad.dtype != torch.float32:
            grad = grad.float()
        if loss_scale != 1.0:  # fp16: unscaled in fp32, the shard's own if fp32
            grad /= loss_scale
        grads.append(grad)
        for segment, view in state.master_segments:
            view.grad = grad[segment.start : segment.end]
        state.grad_shard = None
    return grads


def autograd_gradients(
    states: Sequence[BucketState], buckets: Sequence[FlatBucket]
) -> list[torch.Tensor]:
    """Stage 0 at dp=1 in fp32 (hybrid.engine's `autograd_grads`): each parameter's own
    autograd gradient, flattened without a copy, becomes its per-parameter master view's
    `.grad`, and the parameter lets it go (zero where backward gave none)."""
    grads = []
    for state, bucket in zip(states, buckets, strict=True):
        for param, (_, view) in zip(bucket.params, state.master_segments, strict=True):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            view.grad = grad.reshape(-1)  # a view: autograd's are contiguous
            param.grad = None
            grads.append(view.grad)
    return grads


def any_overflow(
    grads: Sequence[torch.Tensor], groups: Iterable[Group], device: torch.device
) -> bool:
    """Any non-finite gradient on any rank of `groups`: fp16 then skips the step on every
    rank and halves the loss scale."""
    bad = torch.zeros(1, device=device)
    for grad in grads:
        bad = torch.maximum(bad, (~torch.isfinite(grad)).any().float().reshape(1))
    for group in groups:
        group.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


# Elements per piece of a gradient's norm. torch's CPU fp32 norm accumulates one long sum:
# over a 25 MiB bucket segment (6.5M elements) it came out 1.8e-4 low, over 25M elements
# 1.4e-3 (N(0,1) data, float64 reference), and the clip coefficient inherits the error.
# Norms of 64K-element rows, combined in float64, were within 3.1e-7 of the float64 norm
# over 57M elements, in the same time as the whole segments' (9.5 against 10.0 ms, one
# CPU thread).
NORM_PIECE = 1 << 16


def sum_of_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of every element's square over `grads` (1-D), in float64: the fp32 norms
    of `NORM_PIECE`-element rows of each (a view) and of its tail, squared and summed in
    float64. One gradient at a time, so a handful of small tensors exist at once: the step
    runs at the peak of the gradients' memory."""
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for grad in grads:
        whole = grad.numel() // NORM_PIECE * NORM_PIECE
        if whole:
            rows = grad[:whole].view(-1, NORM_PIECE)
            total += torch.linalg.vector_norm(rows, dim=1).double().square().sum()
        if whole < grad.numel():
            total += torch.linalg.vector_norm(grad[whole:]).double().square()
    return total


def global_grad_norm(
    states: Sequence[BucketState], stage: int, dp: Group, tp_group: Group, device: torch.device
) -> float:
    """The L2 norm of the whole model's gradient (the masters' `.grad` views), the same on
    every rank; NaN on every rank when it is not finite on one."""
    kinds = [
        (segment.kind.split, view.grad)
        for state in states
        for segment, view in state.master_segments
    ]
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # (split, replicated)
    for index, split in enumerate((True, False)):
        grads = [grad for is_split, grad in kinds if is_split == split]
        if grads:
            squares[index] = sum_of_squares(grads)
    if stage >= 1:
        dp.all_reduce(squares)
    # The replicated part is the same on every TP rank unless it is not finite on one:
    # its non-finite flag rides along, so every rank returns the same (NaN) norm.
    bad = (~torch.isfinite(squares[1:])).double()
    split_part = tp_group.all_reduce(torch.cat([squares[:1], bad]))
    if split_part[1] > 0:
        return float("nan")
    return float((split_part[0] + squares[1]).sqrt())
