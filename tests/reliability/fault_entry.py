"""launch.pretrain with one injected fault, for the reliability tests:

    HYBRID_FAULT=<kind>:<rank>:<step> python -m torch.distributed.run ... \
        tests/reliability/fault_entry.py \
        --config configs/tiny.yaml key=value ...

kinds, each on global rank <rank> at 1-based step <step>:
- raise          an exception in the middle of the step (after its forward passes)
- hang           the rank stops answering (sleeps) in the middle of the step
- kill           SIGKILL in the middle of the step, on torchrun's first attempt only
- nan            that rank's loss becomes NaN, so its gradients do
- sigterm        SIGTERM to this process (as a scheduler sends) during the step
- save-begin     SIGKILL once the checkpoint of <step> has its temporary folder
- save-shards    SIGKILL with this rank's shard file of <step> half written
- save-commit    SIGKILL after every shard of <step> is written, before the rename
- save-pointer   SIGKILL after the rename of <step>, before `latest` moves

The production code has no hooks for this: the functions are wrapped from outside.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hybrid.checkpoint.engine_state
import hybrid.checkpoint.folders
import launch.train.loop
from launch import pretrain

KIND, RANK, STEP = os.environ.get("HYBRID_FAULT", "none:0:0").split(":")
RANK_HERE = int(os.environ.get("RANK", "0"))
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
MINE = int(RANK) == RANK_HERE and FIRST_ATTEMPT
current_step = 0
signalled: list[bool] = []


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _lr_at(step: int, train: Any) -> float:
    global current_step
    current_step = step + 1
    return original_lr_at(step, train)


def _train_step(engine: Any, micro_batches: list, lr: float, device: Any) -> Any:
    if not MINE or current_step != int(STEP) or KIND.startswith("save-"):
        return original_train_step(engine, micro_batches, lr, device)
    backward = engine.backward

    def faulty_backward(loss: Any) -> None:
        if KIND == "raise":
            raise RuntimeError(f"injected fault on rank {RANK_HERE} at step {current_step}")
        if KIND == "hang":
            time.sleep(3600)
        if KIND == "kill":
            die()
        if KIND == "sigterm" and not signalled:  # once: a second SIGTERM means "now"
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        backward(loss * float("nan") if KIND == "nan" else loss)

    engine.backward = faulty_backward
    try:
        return original_train_step(engine, micro_batches, lr, device)
    finally:
        engine.backward = backward


def _saving_mine(step: int) -> bool:
    return MINE and step == int(STEP)


def _begin(root: Path, step: int) -> Path:
    tmp = original_begin(root, step)
    if _saving_mine(step) and KIND == "save-begin":
        die()
    return tmp


def _save_engine(engine: Any, directory: Path, *args: Any) -> Any:
    written = original_save_engine(engine, directory, *args)
    step = int(directory.name.rsplit("_", 1)[-1])
    if _saving_mine(step) and KIND == "save-shards":
        if hasattr(written, "result"):  # an asynchronous save: once its shards are on disk
            written.result()
        for shard in directory.glob(f"__{RANK_HERE}_*.distcp"):
            data = shard.read_bytes()
            shard.write_bytes(data[: len(data) // 2])
        die()
    return written


def _commit(root: Path, tmp: Path, step: int, state: dict, keep: int, **kwargs: Any) -> Path:
    if _saving_mine(step) and KIND == "save-commit":
        die()
    return original_commit(root, tmp, step, state, keep, **kwargs)


def _write_durably(path: Path, text: str) -> None:
    pointer = path.name == "latest.tmp"
    if pointer and KIND == "save-pointer" and _saving_mine(int(text.rsplit("_", 1)[-1])):
        die()
    original_write_durably(path, text)


original_lr_at, launch.train.loop.lr_at = launch.train.loop.lr_at, _lr_at
original_train_step, launch.train.loop.train_step = launch.train.loop.train_step, _train_step
original_begin, hybrid.checkpoint.engine_state.begin = hybrid.checkpoint.engine_state.begin, _begin
original_save_engine, hybrid.checkpoint.engine_state.save_engine = (
    hybrid.checkpoint.engine_state.save_engine,
    _save_engine,
)
original_commit, hybrid.checkpoint.engine_state.commit = (
    hybrid.checkpoint.engine_state.commit,
    _commit,
)
original_write_durably = hybrid.checkpoint.folders._write_durably
hybrid.checkpoint.folders._write_durably = _write_durably

if __name__ == "__main__":
    sys.exit(pretrain.main())
