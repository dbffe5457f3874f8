"""What a tensor-parallel layer needs to know: its group, whether the sequence is split,
and the TP-region random stream."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hybrid.distributed.comm import Group
from hybrid.distributed.topology import Topology
from hybrid.tensor_parallel.random import TPRandom


@dataclass(frozen=True)
class TensorParallel:
    group: Group
    sequence_parallel: bool
    rng: TPRandom

    @classmethod
    def from_topology(
        cls,
        topology: Topology,
        seed: int,
        sequence_parallel: bool = False,
        device: torch.device | None = None,
    ) -> TensorParallel:
        device = device or torch.device("cpu")
        return cls(topology.tp_group, sequence_parallel, TPRandom(seed, topology.tp_rank, device))

    @classmethod
    def single(cls, seed: int = 0, device: torch.device | None = None) -> TensorParallel:
        return cls.from_topology(Topology.single(), seed, False, device)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def split_region_rng(self) -> contextlib.AbstractContextManager:
        """Random stream for activations that differ across TP ranks."""
        return self.rng.fork()

    def residual_rng(self) -> contextlib.AbstractContextManager:
        """Random stream for the residual stream: replicated across TP ranks (the default
        generator), or split into sequence chunks under sequence parallelism (the TP one)."""
        return self.rng.fork() if self.sequence_parallel else contextlib.nullcontext()
