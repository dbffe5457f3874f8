"""The learning-rate schedule: linear warmup, then cosine decay."""

from __future__ import annotations

import math

from launch.config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to `lr` over
    `warmup_steps`, then cosine decay to `min_lr` at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))
