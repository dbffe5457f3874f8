"""The data phase of a job: local rank 0 of each node prepares (or checks) the token
cache while the node's other ranks wait, then every rank waits for every node.

The waiting uses no collective: a barrier would end the job once preparation outlasts
the process group's timeout (`dist_timeout_s`), and preparing a large corpus can take
hours. Instead the ranks poll keys of the rendezvous store (torch.distributed's default
store): each node's rank 0 sets `done` or `error` (with its one-line message, so that
every rank reports the same problem and nobody hangs), and every rank adds itself to a
counter once its data is open. Store reads are immediate, so no wait meets a timeout.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch.distributed as dist

from hybrid.distributed.env import DistributedEnv
from launch.config import ConfigError

POLL_S = 0.2
_phases = itertools.count()  # every rank runs the same phases in the same order


class DataPhase:
    """One data phase of a job (see the module). With one process, every call is free."""

    def __init__(self, env: DistributedEnv, poll_s: float = POLL_S) -> None:
        self.env = env
        self.poll_s = poll_s
        self.first = env.local_rank == 0
        self.store: Any = None
        if env.world_size > 1:
            self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"data_phase/{next(_phases)}"
        # torchrun numbers ranks node by node: a node's local rank 0 is its first rank.
        self.node_key = f"{self.prefix}/node_{env.rank - env.local_rank}"

    @property
    def verify(self) -> str | None:
        """What prepare_data checks: the configured check once per node (local rank 0);
        the others trust the cache that rank just checked."""
        return None if self.first else "none"

    def wait_for_node(self) -> None:
        """(Not local rank 0.) Until the node's rank 0 has the cache ready; ConfigError
        with its message when it failed."""
        if self.store is None:
            return
        while not self.store.check([self.node_key]):
            time.sleep(self.poll_s)
        self._raise_if_failed(self.store.get(self.node_key).decode())

    def node_done(self, error: str | None = None) -> None:
        """(Local rank 0.) Tell the node's ranks, and the other nodes, how it went."""
        if self.store is None:
            return
        self.store.set(self.node_key, "done" if error is None else f"error:{error}")
        if error is not None:
            self.store.set(f"{self.prefix}/error", error)

    def wait_for_all(self) -> None:
        """Until every rank of every node has its data: the next collective then finds
        everyone there, however long any node prepared."""
        if self.store is None:
            return
        counter = f"{self.prefix}/ready"
        self.store.add(counter, 1)
        while self.store.add(counter, 0) < self.env.world_size:
            if self.store.check([f"{self.prefix}/error"]):
                self._raise_if_failed("error:" + self.store.get(f"{self.prefix}/error").decode())
            time.sleep(self.poll_s)

    @staticmethod
    def _raise_if_failed(status: str) -> None:
        if status.startswith("error:"):
            raise ConfigError(status.removeprefix("error:"))
