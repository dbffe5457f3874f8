"""Gradient bookkeeping across tensor-parallel ranks.

- Under sequence parallelism a replicated parameter (LayerNorm, row-parallel bias,
  position embedding) sees only this rank's sequence chunk, so its gradient is a partial
  sum: all-reduce it over TP before the optimizer (Korthikanti et al. 2022, section 4.2.2).
(The global gradient norm, each parameter counted once, is the Engine's: hybrid.engine.)
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.tensor_parallel.context import TensorParallel
from hybrid.tensor_parallel.shards import parameter_shards


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    split = set(parameter_shards(model))
    return [p for name, p in model.named_parameters() if name not in split]


def sync_sequence_parallel_grads(model: nn.Module, tp: TensorParallel) -> None:
    """All-reduce the partial gradients of replicated parameters (one flat collective)."""
    if not tp.sequence_parallel or tp.size == 1:
        return
    grads = [p.grad for p in replicated_parameters(model) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.group.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
