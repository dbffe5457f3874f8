"""Where imported weights come from, read one rank's piece at a time.

A WeightSource names full (tp=1) tensors under our parameter names and hands out any
range of one TP rank's slice of them, so a rank that keeps 1/8 of a model reads 1/8 of
it: `models.gpt.hf.lazy.HFWeights` reads a Hugging Face folder lazily through its
memory-mapped files; `TensorSource` wraps tensors already in memory. GPT(init_weights=...)
takes either (a plain mapping is wrapped in a TensorSource), so there is one code path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from hybrid.tensor_parallel.shards import ShardSpec, local_slice


class WeightSource(Protocol):
    def names(self) -> list[str]:
        """Our parameter names, every one the source can read."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The full (tp=1) shape of parameter `name`."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """The dtype `read` returns for `name` (the stored one)."""
        ...

    def read(
        self, name: str, spec: ShardSpec | None, tp_rank: int, start: int, end: int
    ) -> torch.Tensor:
        """Flat elements [start, end) of TP rank `tp_rank`'s slice of the full tensor
        `name`, 1-D: `local_slice(full, spec, tp_rank).reshape(-1)[start:end]`, zero
        padding included where the split pads."""
        ...


class TensorSource:
    """A WeightSource over full tensors in memory (a state dict under our names)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(
        self, name: str, spec: ShardSpec | None, tp_rank: int, start: int, end: int
    ) -> torch.Tensor:
        return local_slice(self.tensors[name], spec, tp_rank).reshape(-1)[start:end]


def as_weight_source(weights: Mapping[str, torch.Tensor] | WeightSource) -> WeightSource:
    """A mapping wrapped in a TensorSource; a WeightSource as it is."""
    return TensorSource(weights) if isinstance(weights, Mapping) else weights
