"""Stopping a job between steps: SIGTERM (what Slurm and Kubernetes send before they
preempt) and non-finite losses.

A signal can reach one rank, all of them, or only torchrun (which forwards it). The handler
only sets a flag; at the end of every step the ranks agree on it with one MAX all-reduce
of a single number over the whole world, so they all stop after the same step, save one
checkpoint together and exit 0. A second SIGTERM is left to the default action.

A process that is stuck (a hung rank) would never reach the end of its step, and the
launcher would wait out its whole grace period before SIGKILL. So the handler also starts
a watchdog: unless the step ends within three times the longest step so far (at least
`MIN_GRACE_S`), the process exits with 143, as the default action would have.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import torch
import torch.distributed as dist

from hybrid.distributed.topology import Topology


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


MIN_GRACE_S = 5.0


class Preemption:
    """The SIGTERM flag of this process, and the world's agreement on it."""

    def __init__(self) -> None:
        self.signalled = False
        self.longest_step_s = 0.0
        self._previous = None
        self._watchdog: threading.Timer | None = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
        grace = max(MIN_GRACE_S, 3 * self.longest_step_s)
        self._watchdog = threading.Timer(grace, _give_up, args=(grace,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def step_took(self, seconds: float) -> None:
        self.longest_step_s = max(self.longest_step_s, seconds)

    def requested(self, topology: Topology, device: torch.device) -> bool:
        """True on every rank when any rank was signalled (all ranks must call); the step
        has ended, so a watchdog started by the signal stands down."""
        flag = torch.tensor([float(self.signalled)], device=device)
        topology.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self._watchdog is not None:
            self._watchdog.cancel()
        return bool(flag.item())

    def uninstall(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _give_up(grace: float) -> None:
    print(
        f"error: SIGTERM, and the current step did not end within {grace:.0f} s (a stuck "
        "rank?); exiting without a checkpoint",
        file=sys.stderr,
        flush=True,
    )
    os._exit(143)
