"""Weight gradients written straight into where their owner keeps them (gradient-accumulation
fusion, as Megatron-LM's `gradient_accumulation_fusion` does for its main_grad buffers).

Autograd gives a Linear's weight gradient as a new tensor, which its owner (hybrid.engine)
then copies into a flat gradient bucket: one allocation of the weight's size, its page
faults when that memory is fresh, and one copy pass, per weight per backward. A weight with
a *sink* instead hands its gradient's computation to the sink: `sink(weight, write)`, where
`write(out, accumulate)` computes grad_output^T @ input into `out` (the bucket's view of
the weight, in the weight's dtype), added to it when `accumulate` (the micro-batches of
stages 0-1). Autograd then
gets no gradient for the weight, so no post-accumulate hook runs for it: the sink is that
hook. The result is the same matmul, written elsewhere: equal to autograd's to fp32
rounding of the same gemm.

A sink is set only on the weights of our parallel Linear layers that the model registers
once (hybrid.tensor_parallel.layers.attach_weight_gradient_sinks); a weight registered
twice (tied) keeps autograd's path, which sums its uses first, and so does a weight with a
gradient hook (`register_hook`), so that the hook sees its gradient. A weight also used
outside its layer would get a second gradient from autograd: its owner refuses that with
an error (hybrid.zero.state.BucketState.arrive), since the sum would come too late.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Write = Callable[[torch.Tensor, bool], Any]
Sink = Callable[[nn.Parameter, Write], None]

_SINK = "_hybrid_weight_gradient_sink"


def weight_gradient_sink(weight: torch.Tensor) -> Sink | None:
    """`weight`'s sink, unless a gradient hook is registered on it (`register_hook`, e.g.
    to inspect or change the gradient): autograd's path then, so the hook sees it."""
    return None if weight._backward_hooks else getattr(weight, _SINK, None)


def set_weight_gradient_sink(weight: nn.Parameter, sink: Sink | None) -> None:
    """Route `weight`'s gradient to `sink` (None: back to autograd)."""
    if sink is None:
        if hasattr(weight, _SINK):
            delattr(weight, _SINK)
    else:
        setattr(weight, _SINK, sink)


def weight_gradient(
    weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor
) -> torch.Tensor | None:
    """The weight gradient grad^T @ x (both (tokens, features)): given to the weight's sink
    (returns None: nothing for autograd), else returned, in the weight's dtype. `weight`
    is the parameter itself, not a tensor saved for backward: under recomputation that
    is a copy unpacked by torch.utils.checkpoint, without the sink."""
    sink = weight_gradient_sink(weight)
    if sink is None:
        return grad.t().matmul(x).to(weight.dtype)

    def write(out: torch.Tensor, accumulate: bool) -> None:  # `out` in the weight's dtype
        if accumulate:
            out.addmm_(grad.t(), x)
        else:
            torch.mm(grad.t(), x, out=out)

    sink(weight, write)
    return None
