"""The token-shard format's names and the check of a folder's manifest.

launch.data.shards describes the format (a folder of raw token shards and a
manifest.json) and reads it; launch.data.shard_writer writes it. Both need the format's
name, the manifest's file name, the token dtypes and the shard record, so those live here,
below both: the reader re-exports the writer (its public face) without an import circle.
`_read_manifest` is here too, as it checks exactly these fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "hybrid-token-shards/1"
MANIFEST = "manifest.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True)
class Shard:
    file: str
    n_tokens: int
    xxh3: str


def _read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, checked for our format and its fields; one-line ValueError if not."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(
            f"{folder}: no {MANIFEST}; a token-shard folder needs one (see launch/data/shards.py)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is unreadable ({error}); re-write it with write_token_shards"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(
            f"{path}: format is {found!r}, not {FORMAT!r}; not a hybrid token-shard manifest"
        )
    problem = None
    if manifest.get("dtype") not in DTYPES:
        problem = f"dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    elif not isinstance(manifest.get("vocab_size"), int) or manifest["vocab_size"] < 1:
        problem = f"vocab_size {manifest.get('vocab_size')!r} is not a positive integer"
    elif not isinstance(manifest.get("shards"), list):
        problem = "'shards' is not a list"
    else:
        for i, shard in enumerate(manifest["shards"]):
            if not (
                isinstance(shard, dict)
                and {"file", "n_tokens", "xxh3"} <= set(shard)
                and isinstance(shard["file"], str)
                and isinstance(shard["n_tokens"], int)
                and shard["n_tokens"] >= 0
            ):
                problem = f"shard {i} is not {{file, n_tokens >= 0, xxh3}}: {shard!r}"
                break
        documents = manifest.get("documents")
        if problem is None and documents is not None and len(documents) != len(manifest["shards"]):
            problem = (
                f"'documents' has {len(documents)} entries for {len(manifest['shards'])} shards"
            )
    if problem:
        raise ValueError(f"{path} is unreadable: {problem}; re-write it with write_token_shards")
    return manifest
