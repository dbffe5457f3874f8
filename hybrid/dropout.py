"""Dropout that keeps a 1-byte mask for backward.

`torch.nn.functional.dropout` on CPU saves its mask in the activation's dtype (2 or 4
bytes per element); the activation budget of Korthikanti et al. 2022 (section 4.1) counts
1 byte per element, as a boolean mask costs. The mask is drawn from the current default
generator, so the TP-region stream (hybrid.tensor_parallel.random) and recomputation's
RNG restore apply to it as to any dropout.
"""

from __future__ import annotations

from typing import Any

import torch


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
        ctx.p = p
        ctx.save_for_backward(keep)
        return x * keep / (1.0 - p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return grad * keep / (1.0 - ctx.p), None


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p) when training."""
    if not training or p == 0.0:
        return x
    return _Dropout.apply(x, p)
