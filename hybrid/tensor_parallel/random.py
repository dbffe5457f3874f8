"""A second random stream for dropout inside tensor-parallel regions.

Activations split across TP ranks (attention heads; under sequence parallelism, sequence
chunks) need dropout masks that differ between TP ranks, or every shard would drop the
same pattern. Replicated activations need identical masks on every TP rank, or the
replicas drift apart. Megatron-LM's answer (Shoeybi et al. 2019, section 3): the default
generator is seeded alike on all ranks and serves replicated regions; a second state,
seeded `seed + 2718 + tp_rank`, is swapped into the default generator for the span of a
TP region. Both streams depend only on (seed, tp_rank): identical across DP replicas and
reproducible from the seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

TP_SEED_OFFSET = 2718  # Megatron-LM's offset; any constant that keeps the streams apart


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TPRandom:
    """The TP-region stream: `with rng.fork(): ...` draws dropout masks from it."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device) -> None:
        self.device = device
        generator = torch.Generator(device).manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.state = generator.get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        default = _get_state(self.device)
        _set_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(default, self.device)
