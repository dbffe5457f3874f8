"""Gradient bookkeeping across tensor-parallel ranks.

- Under sequence parallelism a replicated parameter (LayerNorm, row-parallel bias,
  position embedding) sees only this rank's sequence chunk, so its gradient is a partial
  sum: all-reduce it over TP before the optimizer (Korthikanti et al. 2022, section 4.2.2).
- The global gradient norm counts every parameter exactly once: split parameters
  contribute their slice on each rank (summed over TP), replicated ones once.
"""

from __future__ import annotations

import torch
from torch import nn

from .context import TensorParallel
from .shards import parameter_shards


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


@torch.no_grad()
def clip_grad_norm(model: nn.Module, tp: TensorParallel, max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm
    before clipping. `max_norm=inf` only measures."""
    split_names = set(parameter_shards(model))
    squares = torch.zeros(2, dtype=torch.float64)  # (split, replicated)
    grads = []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grads.append(param.grad)
        squares[0 if name in split_names else 1] += param.grad.double().pow(2).sum().cpu()
    split = squares[:1].to(grads[0].device if grads else "cpu")
    tp.group.all_reduce(split)
    norm = float((split.cpu()[0] + squares[1]).sqrt())
    if max_norm < float("inf") and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
