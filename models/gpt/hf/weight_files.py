"""Which files of a Hugging Face checkpoint folder hold its weights: one safetensors file,
an index and its shards, shards without an index, or pytorch_model.bin (with or without
an index); a listed shard that is missing is an error naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

_SHARD = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")


def weight_files(folder: Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """(the file errors name, the files holding the tensors, the index's weight map), the
    first found of: model.safetensors; model.safetensors.index.json;
    model-0000k-of-0000n.safetensors without an index; pytorch_model.bin;
    pytorch_model.bin.index.json."""
    if (folder / "model.safetensors").is_file():
        return folder / "model.safetensors", [folder / "model.safetensors"], None
    if (folder / "model.safetensors.index.json").is_file():
        return _indexed(folder / "model.safetensors.index.json")
    shards = sorted(p for p in folder.glob("model-*-of-*.safetensors") if _SHARD.fullmatch(p.name))
    if shards:
        return folder, _complete_shards(folder, shards), None
    if (folder / "pytorch_model.bin").is_file():
        return folder / "pytorch_model.bin", [folder / "pytorch_model.bin"], None
    if (folder / "pytorch_model.bin.index.json").is_file():
        return _indexed(folder / "pytorch_model.bin.index.json")
    raise FileNotFoundError(
        f"{folder}: no weights; expected model.safetensors, model.safetensors.index.json "
        "or pytorch_model.bin"
    )


def _indexed(index: Path) -> tuple[Path, list[Path], dict[str, str]]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {key: index.parent / name for key, name in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index}: not a readable checkpoint index ({error})") from error
    for key, file in files.items():
        if not file.is_file():
            raise ValueError(
                f"{index}: names {file.name} (for {key!r}), which is not in {index.parent}"
            )
    return index, sorted(set(files.values())), weight_map


def _complete_shards(folder: Path, shards: list[Path]) -> list[Path]:
    """Shards model-0000k-of-0000n without an index: every k of one n, else 'missing'."""
    numbers = [_SHARD.fullmatch(p.name).groups() for p in shards]  # type: ignore[union-attr]
    total = numbers[0][1]
    if any(n != total for _, n in numbers):
        raise ValueError(f"{folder}: shards of different counts ({shards[0].name}, ...)")
    have = {int(k) for k, _ in numbers}
    for k in range(1, int(total) + 1):
        if k not in have:
            name = f"model-{k:0{len(numbers[0][0])}d}-of-{total}.safetensors"
            raise FileNotFoundError(f"{folder / name}: missing shard ({k} of {int(total)})")
    return shards
