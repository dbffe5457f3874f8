"""The value types of hybrid.memory.peak: one moment of a step (bytes by kind) and the
layout a step's moments depend on."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.memory.model_states import grad_element_bytes

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Moment:
    """Bytes one rank holds at one moment of a step, by kind. Of them, `parameters` are in
    parameter storage (stages 0-2: the flat buffers, a model state; stage 3: the gathered
    buckets, a buffer), what MemTracker files under "Parameter"; `unseen` are buffers a
    collective allocated inside itself (gloo's copies of reduce-scatter inputs not being
    waited for), which no tracker at torch's dispatch level (MemTracker) sees then;
    `autograd` are buffers autograd holds rather than the engine (the output layer's and
    the embedding's weight gradients before the engine's hook takes them)."""

    name: str
    model_states: float
    activations: float
    buffers: float
    parameters: float = 0.0
    unseen: float = 0.0
    autograd: float = 0.0

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    @property
    def seen(self) -> float:
        """What a dispatch-level tracker sees at this moment."""
        return self.total - self.unseen


@dataclass(frozen=True)
class StepLayout:
    """What the moments depend on: a hybrid.memory.planner.Layout's fields, and the
    collectives' backend."""

    stage: int
    dp: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_every: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    precision: str = "bf16"
    bucket_mb: float = 25.0
    backend: str = "nccl"
    grad_reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} must be one of {list(BACKENDS)}")
        grad_element_bytes(self.precision, self.grad_reduce_dtype)
