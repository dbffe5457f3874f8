"""Checkpoint folders: crash-safe writes, the `latest` pointer, pruning, safe reading.

    <root>/step_00000010/   .metadata, __<rank>_0.distcp (DCP), trainer_state.json, rng/
    <root>/latest           the name of the newest complete checkpoint

A checkpoint is written into `.tmp-step_<N>` and renamed to `step_<N>` only when every
rank has finished, then `latest` is replaced (atomically) and the oldest complete
checkpoints beyond `keep` are removed. A crash at any point leaves the previous complete
checkpoint and its pointer intact; resume ignores `.tmp-*` folders.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hybrid.checkpoint.raw import RawReadMixin
from hybrid.distributed.comm import Group

STATE_FILE = "trainer_state.json"
TRASH = ".trash-"  # checkpoints past `keep`, renamed, then deleted in a thread
LATEST = "latest"
CHECKSUMS = "checksums"  # checksums/rank<N>.json: the checksum of each file rank N wrote
# The checksum of new records, written "xxh3_128:<hex>": it detects corruption, as a
# checkpoint's checksums are meant to (trust comes from where the folder is; the index and
# tensors load through safe readers whatever the bytes). SHA-256 ran at 0.4-0.55 GB/s on
# this machine's CPU, slower than its disk, so a save spent longer hashing than writing;
# xxh3 runs at 2.5 GB/s. A bare hex digest is an older checkpoint's SHA-256.
CHECKSUM = "xxh3_128"


class CheckpointError(ValueError):
    """A folder that is not a complete checkpoint, or one that does not fit this run."""


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


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / STATE_FILE).is_file()


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


def recorded_checksums(path: Path) -> list[tuple[Path, str, Path]]:
    """(file, its recorded checksum, the record listing it) for every file the checksum
    records list, in name order: the order every rank shares (none for checkpoints
    written before checksums existed)."""
    listed = {}
    for record in sorted((path / CHECKSUMS).glob("rank*.json")):
        try:
            sums = json.loads(record.read_text())
        except ValueError as error:
            raise CheckpointError(f"{record} is corrupt: {error}") from error
        if not isinstance(sums, dict):
            raise CheckpointError(f"{record} is corrupt: not a mapping of file to checksum")
        for name, digest in sums.items():
            listed[name] = (path / name, digest, record)
    return [listed[name] for name in sorted(listed)]


def check_listed_files(path: Path) -> None:
    """CheckpointError naming the first file a checksum record lists that is missing."""
    for file, _, record in recorded_checksums(path):
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing (listed in {record})")


def check_checksums(path: Path, among: Group | None = None) -> None:
    """CheckpointError naming the first file (in name order) whose checksum differs from
    the one recorded at save time (checkpoints written before checksums existed pass).

    Alone (`among=None`), this process hashes every file. `among` a group of ranks (every
    one calls, before anything loads), each rank hashes only its share, about 1/size of
    the bytes (`hashing_share`), and one all-reduce (MIN) of the position of the first
    bad file each rank found tells every rank the same file: all raise the same error."""
    files = recorded_checksums(path)
    rank, world = (0, 1) if among is None else (among.rank, among.size)
    # 2 * position for a file that differs, + 1 if it cannot be read; 2 * len: all good.
    first_bad = 2 * len(files)
    for position in hashing_share([_size(file) for file, _, _ in files], rank, world):
        file, digest, _ = files[position]
        try:
            same = matches_checksum(file, digest)
        except OSError:
            first_bad = 2 * position + 1
            break
        if not same:
            first_bad = 2 * position
            break
    if among is not None:
        first_bad = _min_over_ranks(first_bad, among)
    if first_bad == 2 * len(files):
        return
    file, _, record = files[first_bad // 2]
    if first_bad % 2:
        raise CheckpointError(
            f"checkpoint file {file} is missing or unreadable (listed in {record})"
        )
    raise CheckpointError(
        f"checkpoint file {file} does not match the checksum recorded when it was "
        "written (altered or corrupted): resume from an earlier checkpoint"
    )


def hashing_share(sizes: list[int], rank: int, world: int) -> list[int]:
    """The positions (ascending) of the files `rank` hashes: each file in turn, largest
    first, goes to the rank with the fewest bytes so far (ties: the lower rank), so every
    file is hashed by exactly one rank and each hashes about 1/world of the bytes. Every
    rank computes the same split from the same sizes (a shared file system)."""
    loads = [(0, r) for r in range(world)]
    mine = []
    for position in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, owner = heapq.heappop(loads)
        if owner == rank:
            mine.append(position)
        heapq.heappush(loads, (load + sizes[position], owner))
    return sorted(mine)


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError:  # its hashing rank reports it
        return 0


def _min_over_ranks(value: int, group: Group) -> int:
    """The smallest `value` of the group's ranks, on every one of them (all call)."""
    on_gpu = group.size > 1 and dist.get_backend(group.process_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    group.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item())


def file_checksum(path: Path) -> str:
    """The checksum new records hold ("xxh3_128:<hex>"), read in 4 MiB chunks."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return f"{CHECKSUM}:{digest.hexdigest()}"


def matches_checksum(path: Path, recorded: str) -> bool:
    """Whether a file hashes to `recorded` (a checksum record's entry, new or older)."""
    if recorded.startswith(f"{CHECKSUM}:"):
        return file_checksum(path) == recorded
    return file_sha256(path) == recorded  # written before checksums were xxh3


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
