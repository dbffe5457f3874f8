"""Run a function in N local processes over gloo, as torchrun would (tests, benchmarks).

Each child gets RANK, WORLD_SIZE, LOCAL_RANK and a free MASTER_PORT; its return value or
its traceback comes back through a queue, so a failing rank shows its own error.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    try:
        # Bytes, not tensors: a tensor sent through a queue lives in this process's shared
        # memory, which is gone once this process exits.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_processes(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240) -> list[Any]:
    """Return [fn(*args) on rank 0, ..., on rank N-1]; raise with the first child traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, port, fn, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
