"""Run a function in N local processes over gloo, as torchrun would (tests, benchmarks).

Each child gets RANK, WORLD_SIZE, LOCAL_RANK and a free MASTER_PORT; its return value or
its traceback comes back through a queue, so a failing rank shows its own error.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

# A fork server imports torch (and whatever `preload` names) once; each child is then forked
# from it, single-threaded and clean, instead of re-importing everything (seconds a child).
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def preload(modules: list[str]) -> None:
    """Modules the fork server imports before forking any child (call before the first
    `run_processes`); children then start with them loaded."""
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload(["torch", *modules])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple, queue: Any
) -> None:
    os.environ.clear()  # the parent's environment now, not the fork server's at its start
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # torch was imported before OMP_NUM_THREADS was set (fork server)
    try:
        # Bytes, not tensors: a tensor sent through a queue lives in this process's shared
        # memory, which is gone once this process exits.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def _next_message(queue: Any, procs: list, results: dict, deadline: float) -> tuple:
    """The next child's report. A child that died without one (killed, or unable even to
    start, e.g. a script without the `if __name__ == "__main__"` guard) is named at once
    instead of costing the whole timeout; its last words are read first if they came."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
        if dead:
            try:
                return queue.get(timeout=2.0)
            except queue_module.Empty:
                code = procs[dead[0]].exitcode
                raise AssertionError(
                    f"rank {dead[0]} exited with code {code} before reporting"
                ) from None
        if time.monotonic() > deadline:
            raise TimeoutError("not every rank reported before the timeout")


def run_processes(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240) -> list[Any]:
    """Return [fn(*args) on rank 0, ..., on rank N-1]; raise with the first child traceback."""
    ctx = mp.get_context(START_METHOD)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, port, env, fn, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            rank, status, value = _next_message(queue, procs, results, deadline)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
