"""Our Linear's two-node backward (hybrid.tensor_parallel.linear): autograd's gradients, and
one hidden-sized buffer fewer at its peak than F.linear(F.gelu(u)) holds, measured by
torch's MemTracker (not by our code).

The peak, in hidden-sized (u-sized) tensors beside u itself: F.linear's node holds h, its
input gradient and the gelu gradient to come while GeluBackward runs (3); ours frees h
before the input gradient exists and writes gelu's gradient over it (2). A backward that
computes both gradients in one node, or gelu's gradient into a new tensor, or that is
handed a zero gradient for h, is back at 3.

Tolerance: 1e-6 relative (fp32): the same gemms and the same gelu kernel, in another
order of nodes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from hybrid.tensor_parallel.linear import linear

TOKENS, HIDDEN, OUT = (4, 16), 256, 32


def reference(u: torch.Tensor, w: torch.Tensor, b: torch.Tensor, act: str | None) -> torch.Tensor:
    h = u if act is None else F.gelu(u, approximate="tanh" if act == "gelu_tanh" else "none")
    return F.linear(h, w, b)


def leaves(seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    u = torch.randn(*TOKENS, HIDDEN, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(OUT, HIDDEN) / HIDDEN**0.5)
    b = torch.nn.Parameter(torch.randn(OUT))
    return u, w, b, torch.randn(*TOKENS, OUT)


@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh"])
@pytest.mark.parametrize("recomputed", [False, True])
def test_gradients_are_autograds(act: str | None, recomputed: bool) -> None:
    u, w, b, g = leaves()
    run = (lambda *a: checkpoint(linear, *a, use_reentrant=False)) if recomputed else linear
    run(u, w, b, act).backward(g)
    ours = [t.grad.clone() for t in (u, w, b)]
    for t in (u, w, b):
        t.grad = None
    reference(u, w, b, act).backward(g)
    for mine, theirs in zip(ours, [t.grad for t in (u, w, b)], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def backward_peak(forward) -> int:  # type: ignore[no-untyped-def]
    u, w, b, g = leaves()
    tracker = MemTracker()
    with tracker:
        y = forward(u, w, b, "gelu_tanh")
        y.backward(g)
        del y
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_the_mlp_backward_holds_one_hidden_buffer_fewer() -> None:
    hidden_bytes = TOKENS[0] * TOKENS[1] * HIDDEN * 4
    saved = backward_peak(reference) - backward_peak(linear)
    # One u-sized buffer, less the one-element route tensor (rounded up by the tracker).
    assert hidden_bytes - 1024 <= saved <= hidden_bytes, (saved, hidden_bytes)


def test_an_unknown_activation_is_refused() -> None:
    u, w, b, _ = leaves()
    with pytest.raises(ValueError, match="activation 'relu'"):
        linear(u, w, b, "relu")
