"""What a checkpoint folder holds, by name, and the error for one that is not right: shared
by the folder's writing and checking (folders.py) and its checksums (checksums.py)."""

from __future__ import annotations

from pathlib import Path

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


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / STATE_FILE).is_file()
