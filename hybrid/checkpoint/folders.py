"""Checkpoint folders: crash-safe writes, the `latest` pointer, pruning, safe reading.

    <root>/step_00000010/   .metadata, __<rank>_0.distcp (DCP), trainer_state.json, rng/
    <root>/latest           the name of the newest complete checkpoint

A checkpoint is written into `.tmp-step_<N>` and renamed to `step_<N>` only when every
rank has finished, then `latest` is replaced (atomically) and the oldest complete
checkpoints beyond `keep` are removed. A crash at any point leaves the previous complete
checkpoint and its pointer intact; resume ignores `.tmp-*` folders.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hybrid.checkpoint.checksums import check_checksums, check_listed_files, file_checksum
from hybrid.checkpoint.layout import (
    CHECKSUM,
    CHECKSUMS,
    LATEST,
    STATE_FILE,
    TRASH,
    CheckpointError,
    is_complete,
    step_name,
)
from hybrid.checkpoint.raw import RawReadMixin

__all__ = [
    "CHECKSUM",
    "CHECKSUMS",
    "LATEST",
    "STATE_FILE",
    "TRASH",
    "CheckpointError",
    "SafeReader",
    "check_checksums",
    "is_complete",
    "step_name",
]


class _MetadataUnpickler(pickle.Unpickler):
    """DCP stores its index with pickle; only the index's own plain classes may load, so a
    crafted `.metadata` cannot run code."""

    ALLOWED = frozenset(
        {
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint index refers to {module}.{name}: refused (not data)")


class SafeReader(RawReadMixin, FileSystemReader):
    """DCP's file reader with the index read through `_MetadataUnpickler`; pieces are raw
    bytes (hybrid.checkpoint.raw) or, in checkpoints written before, read by DCP with
    `torch.load(weights_only=True)`: no pickle that could run code either way."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(f"{path} is not a readable checkpoint index: {error}") from error
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold a checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint. `latest` moves only after the rename, so a crash in
    between leaves it one checkpoint behind; the folders, not the pointer, decide."""
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def check_checkpoint(
    path: Path, verify_checksums: bool = True, check_files: bool = True
) -> dict[str, Any]:
    """The trainer state of a complete checkpoint, or a CheckpointError naming the fix.

    With `check_files`, also checks (stat only, before any process group starts) that
    every shard file the index refers to is there and holds at least the bytes the index
    reads from it, and that every file a checksum record lists is there: a missing or
    truncated file is named here instead of failing inside a collective load. With
    `verify_checksums`, also that every file hashes to what its writer recorded, so an
    altered shard is named too; this process reads every file (`check_checksums` with
    `among_ranks` divides that among the ranks of a job)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no .metadata or {STATE_FILE}); pass a "
            "folder written by hybrid, such as <run_dir>/checkpoints/step_00000100"
        )
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except ValueError as error:
        raise CheckpointError(f"{path / STATE_FILE} is corrupt: {error}") from error
    if check_files:
        check_shard_files(path)
        check_listed_files(path)
    if verify_checksums:
        check_checksums(path)
    return state


def record_checksums(tmp: Path, known: dict[str, str] | None = None) -> None:
    """Each rank records the checksum of the files it wrote: its DCP shards and random
    states, and on rank 0 the index (every rank calls, after writing). `known`: file name
    -> checksum of files already hashed while they were written (not read back)."""
    known = known or {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    files = sorted(tmp.glob(f"__{rank}_*.distcp")) + sorted(tmp.glob(f"rng/rank{rank}.pt"))
    if rank == 0 and (tmp / ".metadata").is_file():
        files.append(tmp / ".metadata")
    sums = {str(f.relative_to(tmp)): known.get(f.name) or file_checksum(f) for f in files}
    (tmp / CHECKSUMS).mkdir(exist_ok=True)
    _write_durably(tmp / CHECKSUMS / f"rank{rank}.json", json.dumps(sums, indent=1))


def check_shard_files(path: Path) -> None:
    """CheckpointError naming the first shard file that is missing or shorter than the
    byte ranges the index (`.metadata`) assigns to it."""
    storage = SafeReader(str(path)).read_metadata().storage_data or {}
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint shard {file} is missing; the checkpoint is incomplete: resume "
                "from an earlier one (checkpoint.resume=<folder>) or restore the file"
            )
        if file.stat().st_size < size:
            raise CheckpointError(
                f"checkpoint shard {file} is truncated ({file.stat().st_size} bytes, the "
                f"index reads up to byte {size}): resume from an earlier checkpoint"
            )


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def begin(root: Path, step: int) -> Path:
    """The temporary folder this step's checkpoint is written into (all ranks call)."""
    tmp = root / f".tmp-{step_name(step)}"
    if not dist.is_initialized() or dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def save_rng(tmp: Path, rng: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng, tmp / "rng" / f"rank{rank}.pt")


def load_rng(path: Path) -> dict[str, torch.Tensor] | None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = path / "rng" / f"rank{rank}.pt"
    return torch.load(file, weights_only=True) if file.is_file() else None


def commit(
    root: Path,
    tmp: Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """After every rank wrote into `tmp`: rank 0 adds the trainer state, renames the
    folder, moves `latest` and prunes (all ranks call; barriers on `group`)."""
    barrier(group)
    final = root / step_name(step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write_durably(tmp / STATE_FILE, json.dumps(state, indent=1))
        # A checkpoint of the same step (a rerun from an earlier one) is moved aside, not
        # deleted, until its replacement is in place: a crash never leaves neither.
        old = root / f".old-{final.name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _write_durably(root / f"{LATEST}.tmp", final.name)
        os.replace(root / f"{LATEST}.tmp", root / LATEST)
        complete = complete_checkpoints(root)
        for old in complete[: max(0, len(complete) - keep)]:
            os.replace(old, root / f"{TRASH}{old.name}")  # gone from resume's view at once
        # Deleting the files took ~0.1 s per GB here, and nothing waits on it, so a thread
        # does it (torchtitan prunes in a thread too). A crash mid-way leaves only a
        # `.trash-` folder, which the next commit deletes.
        threading.Thread(target=_empty_trash, args=(root,), daemon=True).start()
    barrier(group)
    return final


def _empty_trash(root: Path) -> None:
    for trash in root.glob(f"{TRASH}*"):
        shutil.rmtree(trash, ignore_errors=True)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
