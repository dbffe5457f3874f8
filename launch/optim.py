"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """Decay weight matrices and embeddings; not biases or LayerNorm gains (GPT-3, 2.2)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to `lr` over
    `warmup_steps`, then cosine decay to `min_lr` at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))
