"""A run's checkpoint saves, synchronous or in the background (checkpoint.async).

The functions are looked up on hybrid.checkpoint.engine_state at each call
(`checkpoint.save_engine`, not an imported name), so what wraps them there
(tests/reliability/fault_entry.py's kill points) wraps both ways of saving."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid.checkpoint import engine_state as checkpoint
from hybrid.checkpoint.folders import step_name
from hybrid.engine import Engine


class CheckpointWriter:
    """A run's checkpoint saves. Synchronous by default; `asynchronous=True` (torchtitan's
    scheme on DCP's async_save) copies this rank's fp32 state to host memory (the only time
    training waits: the stall), then writes, hashes and commits in a background thread
    while training goes on. That thread's collectives run on a process group of their own
    (gloo), so they never interleave with training's; one save is in flight at a time, and
    the next save (or `wait`) waits for it. Crash safety is the synchronous save's: the
    temporary folder, the rename once every rank is done, `latest` last."""

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self.group = None
        if asynchronous and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # every rank calls, in one order
        self._executor = ThreadPoolExecutor(1, "checkpoint") if asynchronous else None
        self._pending: Future | None = None
        self._staged: list[dict[str, torch.Tensor]] | None = None
        self.stall_s = 0.0  # how long the last save held training up

    def save(
        self,
        engine: Engine,
        root: Path,
        step: int,
        trainer_state: dict[str, Any],
        rng: dict[str, torch.Tensor],
        keep: int,
    ) -> Path:
        """Save step `step` (all ranks call); returns the folder it has or will have."""
        tick = time.perf_counter()
        self.wait()
        if self._executor is None:
            path = checkpoint.save_checkpoint(engine, root, step, trainer_state, rng, keep)
            self.stall_s = time.perf_counter() - tick
            return path
        tmp = checkpoint.begin(root, step)
        staged = self._stage(engine)
        rng = {key: value.clone() for key, value in rng.items()}
        upload = checkpoint.save_engine(engine, tmp, staged, self.group)
        self._pending = self._executor.submit(
            self._finish, upload, root, tmp, step, trainer_state, rng, keep
        )
        self.stall_s = time.perf_counter() - tick
        return root / step_name(step)

    def _finish(self, upload: Future, *args: Any) -> Path:
        return checkpoint.finish_save(*args, upload.result(), group=self.group)

    @torch.no_grad()
    def _stage(self, engine: Engine) -> list[dict[str, torch.Tensor]]:
        """A host copy of the engine's fp32 state, in buffers kept for the next save."""
        flats = checkpoint.engine_flats(engine)
        if self._staged is None:
            pin = engine.device.type == "cuda"
            self._staged = [
                {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in f.items()}
                for f in flats
            ]
        for source, copy in zip(flats, self._staged, strict=True):
            for kind, tensor in source.items():
                copy[kind].copy_(tensor)
        return self._staged

    @property
    def pending(self) -> Future | None:
        """The save in flight (its result: the committed folder), if any."""
        return self._pending

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; raises its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
