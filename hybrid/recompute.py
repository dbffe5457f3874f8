"""Activation recomputation policies (Korthikanti et al. 2022, arXiv 2205.05198, section 5).

- `none`: keep every activation.
- `selective`: re-run only the attention core (softmax, dropout, attention over values),
  whose activations grow with s^2 but cost little to recompute.
- `full`: keep only each layer's input and re-run the whole layer in backward.

Recomputation goes through `torch.utils.checkpoint` with `preserve_rng_state=True`, so
dropout masks drawn again in backward equal those of the forward pass and gradients equal
the ones without recomputation.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class Recompute(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


def maybe_recompute(enabled: bool, function: Callable[..., Any], *args: Any) -> Any:
    """Call `function(*args)`, recomputing it in backward when enabled and grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    return function(*args)
