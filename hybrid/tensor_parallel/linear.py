"""F.linear as two autograd nodes, so that backward computes the weight gradient first and
releases the layer's input before the input's gradient is allocated.

Autograd's linear is one node: it saves x and W, computes grad_x = g W and grad_W = g^T x,
and frees x only once both exist, so x and grad_x are alive together. At a backward's
peak (the first layer's MLP, once every later layer's gradients are held: measured with
MemTracker, benchmarks/memory_breakdown.py) that is two b*s*4d/tp tensors for the MLP's
output projection where one would do. Here y = linear(x, W, b) is

    route = _InputGradient(x, W)          # a one-element placeholder of y's shape
    y     = _WeightGradient(route, x, W, b)

Backward reaches _WeightGradient first (it made y): grad_W (to the weight's sink,
hybrid.tensor_parallel.weight_grads, or to autograd) and grad_b, and g passed on to
`route`; autograd then releases the x it saved, and _InputGradient computes grad_x = g W
with the W it saved. The same gemms as F.linear's backward: autograd's gradients to fp32
rounding. Both nodes save through `save_for_backward`, so recomputation's saved-tensor
hooks (torch.utils.checkpoint) and autograd's in-place checks see them as they see
F.linear's.

`activation` folds a GELU in front: y = linear(gelu(x), W, b). _InputGradient then also
makes h = gelu(x) (saved by _WeightGradient) and writes gelu's gradient over grad_h in
place, so grad_h and grad_x (both b*s*4d/tp in the MLP) never coexist either: the GELU
has no autograd node of its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybrid.tensor_parallel.weight_grads import weight_gradient

GELU_APPROXIMATION = {"gelu": "none", "gelu_tanh": "tanh"}  # activation -> F.gelu's approximate


class _InputGradient(torch.autograd.Function):
    """The route y's gradient takes to x: grad_x = g W (through gelu' with an activation)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, approximate: str | None) -> Any:
        ctx.approximate = approximate
        ctx.set_materialize_grads(False)  # else h's absent gradient is made as zeros, b*s*4d
        # y's shape with one element behind it: the gradient that reaches it is g, whole.
        route = x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])
        if approximate is None:
            ctx.save_for_backward(weight, None)
            return route
        ctx.save_for_backward(weight, x)
        h = F.gelu(x, approximate=approximate)
        ctx.mark_non_differentiable(h)  # its gradient is computed here, from `route`'s
        return route, h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        weight, x = ctx.saved_tensors
        if grad is None or not ctx.needs_input_grad[0]:
            return None, None, None
        grad_input = grad.matmul(weight)
        if ctx.approximate is not None:  # gelu'(x) * grad_h, written over grad_h
            torch.ops.aten.gelu_backward.grad_input(
                grad_input, x, approximate=ctx.approximate, grad_input=grad_input
            )
        return grad_input, None, None


class _WeightGradient(torch.autograd.Function):
    """y = x W^T + b; its backward gives grad_W and grad_b and hands g to the route."""

    @staticmethod
    def forward(
        ctx: Any,
        route: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        # The parameter itself, not a saved copy: under recomputation a saved tensor is
        # unpacked by torch.utils.checkpoint as a new tensor, without the sink.
        ctx.has_bias, ctx.parameter = bias is not None, weight
        ctx.save_for_backward(x)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = weight_gradient(ctx.parameter, flat_grad, x.reshape(-1, x.shape[-1]))
        grad_bias = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad, None, grad_weight, grad_bias


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), or F.linear(gelu(x), ...) with `activation` ("gelu",
    "gelu_tanh"), whose backward frees x before it allocates x's gradient (see above)."""
    if activation is not None and activation not in GELU_APPROXIMATION:
        raise ValueError(f"activation {activation!r}: expected one of {list(GELU_APPROXIMATION)}")
    approximate = GELU_APPROXIMATION.get(activation)  # None: no activation
    recorded = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    if not recorded:
        h = x if approximate is None else F.gelu(x, approximate=approximate)
        return F.linear(h, weight, bias)
    routed = _InputGradient.apply(x, weight, approximate)
    route, h = (routed, x) if approximate is None else routed
    return _WeightGradient.apply(route, h, weight, bias)
