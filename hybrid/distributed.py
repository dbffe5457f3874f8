"""Process-group start-up and shut-down for torchrun jobs and single processes.

The backend follows the hardware: nccl when CUDA is present, gloo otherwise; nothing in
the library hard-codes either.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job. `world_size == 1` means no process group."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """The job's size as torchrun announces it; 1 for a plain `python` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: float = 600.0) -> DistributedEnv:
    """Create the default process group when launched by torchrun (WORLD_SIZE > 1)."""
    world_size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size == 1:
        return DistributedEnv(0, 0, 1, device, None)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return DistributedEnv(rank, local_rank, world_size, device, backend)


def barrier(env: DistributedEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def shutdown(env: DistributedEnv) -> None:
    """Barrier before destroy: without it gloo processes can abort at exit (DESIGN.md 5)."""
    if env.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
