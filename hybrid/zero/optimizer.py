"""The optimizer of hybrid.engine: torch AdamW over each bucket's fp32 master shard, with
its moments laid out as the shard is (ZeRO's optimizer-state partition, section 5.1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid.engine_config import EngineConfig
from hybrid.zero.bucket import FlatBucket
from hybrid.zero.state import BucketState


def make_adamw(
    states: Sequence[BucketState],
    buckets: Sequence[FlatBucket],
    config: EngineConfig,
    device: torch.device,
    per_parameter: bool = False,
) -> torch.optim.Optimizer:
    """torch AdamW (the config's weight decay, betas, eps) over the master shard's kind
    segments: decay and no-decay groups. Its update is elementwise, so stepping a slice of
    the flat shard is stepping the parameters it cuts through (the same arithmetic as on
    whole tensors). `per_parameter`: one segment per parameter instead (a whole,
    unsharded bucket), so autograd's gradient of each is its segment's `.grad` as it is."""
    weight_decay, betas, eps = config.weight_decay, config.betas, config.eps
    decay, no_decay = [], []
    for state, bucket in zip(states, buckets, strict=True):
        for segment in bucket.parameter_segments() if per_parameter else bucket.segments:
            view = state.master[segment.start : segment.end]
            state.master_segments.append((segment, view))
            (decay if segment.kind.decay else no_decay).append(view)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=0.0,
        betas=betas,
        eps=eps,
        fused=True,  # one kernel per flat segment (CPU and CUDA): ~10x the for-loop
    )
    # Adam's moments are views into flat per-bucket tensors, like the master shard, so
    # a checkpoint reads and writes them by the same layout (torch keeps a state it
    # finds instead of creating one). Fused AdamW counts steps in fp32 tensors.
    for state in states:
        for segment, view in state.master_segments:
            part = slice(segment.start, segment.end)
            optimizer.state[view] = {
                "step": torch.zeros((), dtype=torch.float32, device=device),
                "exp_avg": state.exp_avg[part],
                "exp_avg_sq": state.exp_avg_sq[part],
            }
    return optimizer


def step_adamw(
    optimizer: torch.optim.Optimizer, lr: float, divisor: float | None, device: torch.device
) -> None:
    """One AdamW step at `lr` on gradients divided by `divisor` (the clip: ||g|| / max_norm
    when the norm exceeds it; None: as they are). The division happens inside the fused
    kernel as it reads each gradient, the path torch's GradScaler unscales by
    (`grad_scale`), where multiplying the gradients first would be one more pass over
    all of them: about 20 ms per 57M fp32 gradients on one CPU thread, 1% of a step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if divisor is not None:
        optimizer.grad_scale = torch.tensor(divisor, dtype=torch.float32, device=device)
    try:
        optimizer.step()
    finally:
        optimizer.__dict__.pop("grad_scale", None)  # the next step's clip is its own
