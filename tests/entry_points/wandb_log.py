"""Read the history rows out of an offline W&B run file (`run-<id>.wandb`), for tests.

The file is wandb's header (":W&B", 0xBEE1, version) followed by a LevelDB-style log:
32 KiB blocks of chunks, each with a 7-byte header (crc32c, little-endian length, type
FULL=1 FIRST=2 MIDDLE=3 LAST=4); a record is one protobuf `Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # trailer padding at the end of a block
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a record is complete
            out.append(pending)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows, each with its `_step`."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or ".".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows
