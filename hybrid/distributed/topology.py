"""The 2D (dp, tp) process topology.

Ranks are laid out row-major on a (dp, tp) mesh, tensor-parallel innermost:
global rank = dp_rank * tp + tp_rank. With torchrun's node-major rank order, a TP group is
tp consecutive ranks and stays inside a node (its all-reduces need the fast links), while a
DP group strides across nodes (ZeRO's reduce-scatter and all-gather tolerate slower links).

One Topology is built per job and passed explicitly to whatever needs a group: its tp and
dp groups, and `world` for what the whole job agrees on (preemption, peak memory). Every
collective of the library goes through one of these Groups, so the CollectiveCounter sees
it; there are no module-level process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybrid.distributed.comm import CollectiveCounter, Group


def check_layout(world_size: int, tp: int) -> int:
    """Return dp for `world_size` ranks at tensor-parallel degree `tp`, or raise."""
    if tp < 1 or world_size < 1:
        raise ValueError(f"world size ({world_size}) and tp ({tp}) must be positive")
    if world_size % tp:
        raise ValueError(
            f"world size {world_size} is not divisible by tp={tp}; launch a multiple of {tp} "
            "processes or change tp"
        )
    return world_size // tp


@dataclass(frozen=True)
class Topology:
    world_size: int
    tp: int
    dp: int
    rank: int
    tp_rank: int
    dp_rank: int
    tp_group: Group
    dp_group: Group
    counter: CollectiveCounter
    mesh: DeviceMesh | None  # None for a single process
    world: Group = field(default_factory=lambda: Group.single("world"))

    @classmethod
    def build(cls, tp: int = 1, device_type: str = "cpu") -> Topology:
        """The topology of the current job (the default process group must exist when the
        world has more than one rank). Sizes are checked before any group is created."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        dp = check_layout(world_size, tp)
        if world_size == 1:
            return cls.single()
        counter = CollectiveCounter()
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        rank = dist.get_rank()
        tp_group = Group("tp", mesh.get_group("tp") if tp > 1 else None, counter)
        dp_group = Group("dp", mesh.get_group("dp") if dp > 1 else None, counter)
        world = Group.whole_job(counter)
        return cls(
            world_size,
            tp,
            dp,
            rank,
            rank % tp,
            rank // tp,
            tp_group,
            dp_group,
            counter,
            mesh,
            world,
        )

    @classmethod
    def single(cls) -> Topology:
        """One process, no process group: every collective is the identity."""
        counter = CollectiveCounter()
        return cls(
            1,
            1,
            1,
            0,
            0,
            0,
            Group.single("tp", counter),
            Group.single("dp", counter),
            counter,
            None,
        )

    def describe(self) -> str:
        return f"world {self.world_size} = dp {self.dp} x tp {self.tp}"
