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

from hybrid.distributed.comm import Group
from hybrid.distributed.host_memory import release_freed_memory


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job. `world_size == 1` means no process group."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def world(self) -> Group:
        """The whole job as a Group (before a Topology exists: resume verification)."""
        return Group.whole_job()

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
        release_freed_memory()  # freed ZeRO buffers leave the resident set (host_memory)
    if world_size == 1:
        return DistributedEnv(0, 0, 1, device, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        store=_attempt_store(rank, world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    return DistributedEnv(rank, local_rank, world_size, device, backend)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, its keys prefixed by torchrun's restart count.

    After a failure, `torchrun --max-restarts` starts new workers against the same store
    (torch 2.13, --standalone), where the dead attempt's keys are still set: gloo would
    read a dead rank's address and fail with "connection refused". A prefix per attempt
    keeps each attempt's rendezvous apart.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hybrid/attempt_{attempt}", store)


def barrier(env: DistributedEnv) -> None:
    if env.world_size > 1:
        dist.barrier(group=dist.group.WORLD)


def shutdown(env: DistributedEnv) -> None:
    """Barrier before destroy: without it gloo processes can abort at exit (DESIGN.md 5)."""
    if env.world_size > 1 and dist.is_initialized():
        dist.barrier(group=dist.group.WORLD)
        dist.destroy_process_group()
