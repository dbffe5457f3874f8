"""What the Engine holds, counted from its tensors, each storage once (no allocator hooks,
no formulas: hybrid.memory predicts these numbers and tests/planning/test_plan.py compares them).

- model states: parameters (the flat buffers at stages 0-2, the shards at 3), gradients
  when the last backward ended (the full flat buffers at stage 0, the reduced shards at
  1-3), optimizer (the fp32 master where it is not the parameters themselves, and Adam's
  moments);
- transient buffers, whose peak the Engine tracks: full gradient buckets (accumulating
  over micro-batches at stage 1, in flight at stages 1-3), reduce-scatter outputs not yet
  folded into the shards, gathered parameters (stage 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybrid.zero.gather import ParameterGatherer
from hybrid.zero.state import BucketState


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def transient_bytes(
    states: Sequence[BucketState],
    pending: Sequence[tuple[int, Any, torch.Tensor, torch.Tensor]],
    stage: int,
    gatherer: ParameterGatherer | None,
) -> int:
    """Bytes of the buffers alive now that are not model states: pending reductions'
    inputs and outputs, gradient buffers or shards that are not the persistent ones, and
    at stage 3 the gathered parameters."""
    persistent = {id(s.param_storage) for s in states}
    if stage == 0:
        persistent |= {id(s.grad_flat) for s in states}
    else:
        persistent |= {id(s.grad_shard) for s in states}
    transient = [t for _, _, out, flat in pending for t in (out, flat)]
    transient += [s.grad_flat for s in states] + [s.grad_shard for s in states]
    unique = {id(t): t for t in transient if t is not None and id(t) not in persistent}
    held = sum(nbytes(t) for t in unique.values())
    return held + (gatherer.held_bytes() if gatherer is not None else 0)


def model_state_bytes(
    states: Sequence[BucketState], grad_bytes: int, peak_buffer_bytes: int
) -> dict[str, int]:
    """Parameters, gradients (`grad_bytes`, held when the last backward ended), optimizer,
    and the peak of transient buffers (`peak_buffer_bytes`)."""
    optimizer = sum(nbytes(s.master) for s in states if s.master is not s.param_shard)
    optimizer += sum(nbytes(s.exp_avg) + nbytes(s.exp_avg_sq) for s in states)
    return {
        "parameters": sum(nbytes(s.param_storage) for s in states),
        "gradients": grad_bytes,
        "optimizer": optimizer,
        "buffers": peak_buffer_bytes,
    }
