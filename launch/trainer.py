"""One optimizer step and one evaluation pass through the hybrid Engine.

Gradient accumulation: every DP rank runs G / (micro x dp) micro-batches; the engine scales
each micro-batch loss by their number and reduces gradients as its ZeRO stage allows
(once per step at stages 0-1, per micro-batch at 2-3), so the gradient is that of the mean
loss over the global batch. TP ranks of one DP replica see the same batch and report the
same loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybrid.comm import Group
from hybrid.engine import Engine


def train_step(
    engine: Engine, micro_batches: list[torch.Tensor], lr: float, device: torch.device
) -> tuple[float, float, bool]:
    """Forward, backward and update on this rank's micro-batches.

    Returns (mean loss over the global batch, gradient norm before clipping, skipped).
    """
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        batch = batch.to(device, non_blocking=True)
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        loss_sum += loss.detach().float() / len(micro_batches)
    stats = engine.step(lr)
    return _mean_over(loss_sum, engine.dp), stats.grad_norm, stats.skipped


@torch.no_grad()
def evaluate(
    engine: Engine, batches: list[torch.Tensor], dp_group: Group, device: torch.device
) -> float:
    """Mean loss over the validation set, every sample counted once across DP ranks."""
    model = engine.module
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss x samples, samples)
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        loss = engine(batch[:, :-1], batch[:, 1:])
        totals += torch.stack([loss.double() * len(batch), torch.tensor(len(batch)).double()])
    dp_group.all_reduce(totals)
    model.train(was_training)
    return float(totals[0] / totals[1])


def _mean_over(value: torch.Tensor, group: Group) -> float:
    return float(group.all_reduce(value.clone()) / group.size)


def eval_steps(total_steps: int, every: int) -> Iterator[int]:
    """1-based steps after which the model is evaluated: the first (a baseline), every
    `every`-th, and the last."""
    yield from sorted({1, total_steps, *range(every, total_steps + 1, every)})
