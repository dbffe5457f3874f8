"""Worker functions for test_checkpoint_async.py: a save's collectives counted where
torch.distributed is called, and an asynchronous save while training goes on."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from checkpoint_cases import build, train_steps
from tp_cases import in_process_group

from hybrid.checkpoint.engine_state import gather_full_states, load_checkpoint, save_engine
from hybrid.checkpoint.hashing import HashingWriter
from hybrid.checkpoint.saver import CheckpointWriter

# torch.distributed's collectives, object ones included (those do not reach the dispatcher,
# so hybrid.instruments.dispatch_counters cannot see them); counted where DCP calls them.
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "monitored_barrier",
)  # fmt: skip


@contextlib.contextmanager
def counted_collectives() -> Iterator[list[str]]:
    """The names of the torch.distributed collectives called while active."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return function(*args, **kwargs)

        return call

    for name, function in originals.items():
        setattr(dist, name, counting(name, function))
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def count_save_collectives(root: str) -> dict[str, Any]:
    """Collectives one save's shards and index cost on this rank (tp=1, dp=2, stage 3)."""

    def work() -> dict[str, Any]:
        engine, _ = build(1, 3, seed=3)
        keys = 3 * sum(len(bucket.names) for bucket in engine.buckets)
        with counted_collectives() as calls:
            save_engine(engine, Path(root))
        return {"collectives": calls, "keys": keys}

    return in_process_group(work)


@contextlib.contextmanager
def writes_held(release: threading.Event) -> Iterator[None]:
    """Every shard write (in the background thread of an asynchronous save) waits for
    `release`: the bytes are written after training has gone on, whatever the machine's
    speed, so a save that wrote the live tensors and not its staged copy is always seen."""
    original = HashingWriter.write_data

    def held(self: HashingWriter, *args: Any, **kwargs: Any) -> Any:
        assert release.wait(timeout=120), "the training steps never released the write"
        return original(self, *args, **kwargs)

    HashingWriter.write_data = held
    try:
        yield
    finally:
        HashingWriter.write_data = original


def save_while_training(root: str, asynchronous: bool) -> dict[str, Any]:
    """Train 2 steps, save step 2 (in the background when `asynchronous`, its writes held
    until), train 2 more before waiting, then load the checkpoint into a fresh engine: it
    must hold the state of step 2, not of the steps trained while it was written."""

    def work() -> dict[str, Any]:
        engine, topology = build(1, 3, seed=3)
        train_steps(engine, topology, range(2))
        at_save = gather_full_states(engine)
        writer = CheckpointWriter(asynchronous)
        release = threading.Event()
        with writes_held(release) if asynchronous else contextlib.nullcontext():
            folder = writer.save(engine, Path(root), 2, {"adam_steps": engine.adam_steps}, {}, 1)
            train_steps(engine, topology, range(2, 4))
            release.set()
            assert writer.wait() in (None, folder)
        writer.close()
        fresh, _ = build(1, 3, seed=99)
        load_checkpoint(fresh, folder)
        sums = {}
        for record in sorted((folder / "checksums").glob("rank*.json")):
            for name, digest in json.loads(record.read_text()).items():
                sums[name] = digest == independent_checksum(folder / name)
        return {
            "at_save": at_save,
            "loaded": gather_full_states(fresh),
            "later": gather_full_states(engine),
            "checksums_match": sums,
        }

    return in_process_group(work)


def independent_checksum(path: Path) -> str:
    """The record's format, computed here from the file's bytes (not by the code under
    test): xxh3-128 of the whole file."""
    return "xxh3_128:" + xxhash.xxh3_128(path.read_bytes()).hexdigest()
