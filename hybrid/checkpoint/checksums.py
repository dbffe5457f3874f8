"""A checkpoint's checksums checked: every file its ranks recorded at save time, hashed
again before anything loads, by this process alone or divided among the ranks of a group
(each hashes about 1/size of the bytes; one all-reduce tells every rank the verdict).
The records themselves are written at commit (folders.record_checksums)."""

from __future__ import annotations

import hashlib
import heapq
import json
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from hybrid.checkpoint.layout import CHECKSUM, CHECKSUMS, CheckpointError
from hybrid.distributed.comm import Group


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
