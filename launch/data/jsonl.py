"""Reading jsonl files (optionally gzipped) line by line, so that a malformed line is an
error naming the file and the line, not a parser's message about an offset."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, record) for every non-blank line; ValueError `<file>:<line>: not valid
    JSON` on the first line that does not parse."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({error.msg}); fix or remove the line"
                ) from None
