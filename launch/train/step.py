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

from hybrid.distributed.comm import Group
from hybrid.engine import Engine
from models.gpt import IGNORE_INDEX

# A window of tokens; or supervised (inputs, targets); or packed examples' (inputs,
# targets, segments), segments naming each token's example (launch.data.examples).
Batch = torch.Tensor | tuple[torch.Tensor, ...]


def split_batch(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) on `device`: a packed window of seq_len + 1 tokens is cut into its
    inputs and the same tokens shifted by one; supervised examples come already split,
    with IGNORE_INDEX targets where no loss is taken."""
    if isinstance(batch, tuple):
        return to_device(batch[0], device), to_device(batch[1], device)
    window = to_device(batch, device)  # one copy; cut on the device
    return window[:, :-1], window[:, 1:]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. To CUDA through pinned memory: a copy from pageable memory
    makes the host wait for it, one from pinned memory is queued on the stream, so a
    step's micro-batches (train_step copies them all first) arrive while the first one
    computes. torch's pinned allocator caches the blocks and keeps each until its copy
    is done. On CPU: the tensor itself."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def model_options(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's keyword arguments beyond (inputs, targets): packed examples' segment
    ids; nothing for other batches, whose forward is unchanged."""
    if isinstance(batch, tuple) and len(batch) == 3:
        return {"segments": to_device(batch[2], device)}
    return {}


def train_step(
    engine: Engine, micro_batches: list[Batch], lr: float, device: torch.device
) -> tuple[float, float, bool]:
    """Forward, backward and update on this rank's micro-batches.

    The loss is the mean over every target token of the global batch. With packed windows
    each micro-batch holds the same number of tokens, so it is the mean of micro-batch
    means. With masked targets (supervised examples) micro-batches hold different numbers:
    the count over the global batch is summed across DP first (one scalar all-reduce), and
    each micro-batch's loss is its sum times micro x dp over that count, which the Engine's
    1/(micro x dp) scaling turns into the global mean.

    Returns (mean loss over the global batch, gradient norm before clipping, skipped).
    """
    pairs = [split_batch(batch, device) for batch in micro_batches]
    options = [model_options(batch, device) for batch in micro_batches]
    loss_tokens = None
    if isinstance(micro_batches[0], tuple):
        count = sum((y != IGNORE_INDEX).sum() for _, y in pairs).to(torch.float64)
        engine.dp.all_reduce(count)
        loss_tokens = (count.clamp(min=1) / (len(pairs) * engine.dp.size)).float()
    loss_sum = torch.zeros((), device=device)
    for (inputs, targets), extra in zip(pairs, options, strict=True):
        loss = engine(inputs, targets, loss_tokens, **extra)
        engine.backward(loss)
        loss_sum += loss.detach().float() / len(pairs)
    stats = engine.step(lr)
    return _mean_over(loss_sum, engine.dp), stats.grad_norm, stats.skipped


@torch.no_grad()
def evaluate(engine: Engine, batches: list[Batch], dp_group: Group, device: torch.device) -> float:
    """Mean loss over every target token of the validation set, each sample counted once
    across DP ranks."""
    model = engine.module
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, target tokens)
    for batch in batches:
        inputs, targets = split_batch(batch, device)
        tokens = (targets != IGNORE_INDEX).sum().double()
        loss = engine(inputs, targets, **model_options(batch, device)).double()
        totals += torch.stack([loss * tokens, tokens])
    dp_group.all_reduce(totals)
    model.train(was_training)
    return float(totals[0] / totals[1].clamp(min=1))


def _mean_over(value: torch.Tensor, group: Group) -> float:
    return float(group.all_reduce(value.clone()) / group.size)


def eval_steps(total_steps: int, every: int) -> Iterator[int]:
    """1-based steps after which the model is evaluated: the first (a baseline), every
    `every`-th, and the last."""
    yield from sorted({1, total_steps, *range(every, total_steps + 1, every)})
