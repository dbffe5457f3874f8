"""One optimizer step and one evaluation pass, for any model that maps (x, y) to a mean loss.

Data parallelism is torch's DistributedDataParallel over the DP group for now (the ZeRO
issue replaces it with the hybrid engine). Gradient accumulation: every DP rank runs
G / (micro x dp) micro-batches; DDP reduces gradients only on the last one (`no_sync` on
the others), and each micro-batch loss is divided by their number, so the gradient is that
of the mean loss over the global batch (DDP averages over DP ranks). TP ranks of one DP
replica see the same batch and report the same loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybrid.comm import Group
from hybrid.tensor_parallel import TensorParallel, clip_grad_norm, sync_sequence_parallel_grads


class Precision:
    """Autocast and, for fp16, a dynamic loss scaler; fp32 does nothing."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.device_type = device.type
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def _accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()  # reduce gradients once, on the last micro-batch
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    precision: Precision,
    grad_clip: float,
    tp: TensorParallel,
    dp_group: Group,
    device: torch.device,
) -> tuple[float, float]:
    """Forward, backward and update on this rank's micro-batches.

    Returns (mean loss over the global batch, gradient norm before clipping).
    """
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        batch = batch.to(device, non_blocking=True)
        with _accumulating(model, last=i == len(micro_batches) - 1):
            with precision.autocast():
                loss = model(batch[:, :-1], batch[:, 1:]) / len(micro_batches)
            precision.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    raw_model = model.module if isinstance(model, DistributedDataParallel) else model
    sync_sequence_parallel_grads(raw_model, tp)
    precision.scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(raw_model, tp, grad_clip if grad_clip > 0 else float("inf"))
    precision.scaler.step(optimizer)
    precision.scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return _mean_over(loss_sum, dp_group), grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list[torch.Tensor],
    precision: Precision,
    dp_group: Group,
    device: torch.device,
) -> float:
    """Mean loss over the validation set, every sample counted once across DP ranks."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss x samples, samples)
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with precision.autocast():
            loss = model(batch[:, :-1], batch[:, 1:])
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
