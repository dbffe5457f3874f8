"""Stopping a job between steps: SIGTERM (what Slurm and Kubernetes send before they
preempt) and non-finite losses.

A signal can reach one rank, all of them, or only torchrun (which forwards it). The handler
only sets a flag; at the end of every step the ranks agree on it with one MAX all-reduce
of a single number over the whole world, so they all stop after the same step, save one
checkpoint together and exit 0. A second SIGTERM is left to the default action.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from hybrid.topology import Topology


class NonFiniteLoss(RuntimeError):
    """train.on_nonfinite=stop: a step's loss or gradient was NaN or inf (on some rank; all
    ranks raise alike, since the gradient norm is reduced over the world)."""

    exit_code = 3

    def __init__(self, step: int) -> None:
        super().__init__(
            f"step {step}: the loss or a gradient is NaN or inf on some rank; stopped "
            "without updating or saving (train.on_nonfinite=stop). Resume from the last "
            "checkpoint, with a lower train.lr or train.on_nonfinite=skip"
        )
        self.step = step


class Preemption:
    """The SIGTERM flag of this process, and the world's agreement on it."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process

    def requested(self, topology: Topology, device: torch.device) -> bool:
        """True on every rank when any rank was signalled (all ranks must call)."""
        flag = torch.tensor([float(self.signalled)], device=device)
        if dist.is_initialized() and topology.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
