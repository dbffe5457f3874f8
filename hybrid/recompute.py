"""Activation recomputation policies (Korthikanti et al. 2022, arXiv 2205.05198, section 5).

- `none`: keep every activation.
- `selective`: re-run only the attention core (softmax, dropout, attention over values),
  whose activations grow with s^2 but cost little to recompute.
- `full`: keep only each layer's input and re-run the whole layer in backward; `every=k`
  applies it to every k-th layer only (layers 0, k, 2k, ...), trading memory for compute.

Recomputation uses `torch.utils.checkpoint` (non-reentrant). It restores the default
generator (`preserve_rng_state`), and a context pair restores the TP-region stream to its
state at the start of the forward, so dropout masks drawn again in backward equal those of
the forward pass: gradients equal the ones without recomputation.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from hybrid.tensor_parallel.random import TPRandom


class Recompute(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True)
class RecomputePolicy:
    mode: Recompute = Recompute.NONE
    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"recompute every={self.every} must be at least 1")

    def full_layer(self, index: int) -> bool:
        return self.mode is Recompute.FULL and index % self.every == 0

    @property
    def attention_core(self) -> bool:
        return self.mode is Recompute.SELECTIVE


def _restore_tp_stream(rng: TPRandom) -> tuple[Any, Any]:
    saved: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved["state"] = rng.state
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        current, rng.state = rng.state, saved["state"]
        try:
            yield
        finally:
            rng.state = current

    return forward(), recompute()


def maybe_recompute(
    enabled: bool, function: Callable[..., Any], *args: Any, rng: TPRandom | None = None
) -> Any:
    """Call `function(*args)`, recomputing it in backward when enabled and grad is on."""
    if not (enabled and torch.is_grad_enabled()):
        return function(*args)
    contexts = (lambda: _restore_tp_stream(rng)) if rng is not None else None
    kwargs = {"context_fn": contexts} if contexts is not None else {}
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
