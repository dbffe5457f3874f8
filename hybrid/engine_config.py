"""What an Engine is asked to do (EngineConfig), checked before anything is built, and what
a step reports (StepStats)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class EngineConfig:
    zero_stage: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (dynamic loss scaling)
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    grad_clip: float = 0.0  # max global gradient norm; 0 = off
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000  # good fp16 steps before the scale doubles
    # Stages 0-2: consecutive units share a bucket up to this size (DDP's default cap), so
    # a small model is reduced in few, large collectives. Stage 3 gathers unit by unit.
    bucket_mb: float = 25.0
    # Gradients' dtype from autograd's copy on: the flat buffers, the micro-batch sum, the
    # DP reduction and the shards. "fp32" (Megatron's and DeepSpeed's default) sums bf16 or
    # fp16 gradients without rounding each addition to 8 (or 11) mantissa bits; "bf16"
    # keeps them in the 16-bit compute dtype (bf16 or fp16): half the reduction traffic.
    # fp32 precision reduces in fp32 either way.
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16
    # Stages 1-2: each bucket's parameter all-gather after the step is waited for just
    # before the first forward that reads it (hybrid.zero.publish), so it overlaps the
    # next forward; False waits for all of them in the step. Same values either way.
    overlap_param_gather: bool = True


@dataclass
class StepStats:
    grad_norm: float
    skipped: bool
    loss_scale: float


def check_engine_config(config: EngineConfig) -> None:
    """ValueError naming the field, before any bucket or collective exists."""
    if config.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={config.zero_stage} must be 0, 1, 2 or 3")
    if config.precision not in DTYPES:
        raise ValueError(f"precision={config.precision!r} must be one of {list(DTYPES)}")
    if config.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ValueError(
            f"grad_reduce_dtype={config.grad_reduce_dtype!r} must be one of "
            f"{list(GRAD_REDUCE_DTYPES)}"
        )


def keeps_autograd_gradients(config: EngineConfig, dp_size: int, sequence_parallel: bool) -> bool:
    """Stage 0 with one DP rank has nothing to reduce: in fp32 autograd's own gradients are
    the step's (the master is the parameter), as in a plain loop, so no bucket buffer opens
    and no gradient is copied (hybrid.zero.gradients.autograd_gradients). Sequence
    parallelism sums replicated parameters' gradients over TP in the buckets: kept there."""
    return (
        config.zero_stage == 0
        and dp_size == 1
        and config.precision == "fp32"
        and not sequence_parallel
    )
