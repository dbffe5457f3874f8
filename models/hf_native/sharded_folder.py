"""The weights of a Hugging Face folder written from a stream of tensors, one at a time:
sharded safetensors files and their index, as save_pretrained lays them out.

What goes in which file is decided up front from the layout (names, shapes and dtypes are
known before any byte is), and each file is streamed by
hybrid.checkpoint.full_state.write_safetensors, header first. Shards follow
save_pretrained's rule (huggingface_hub's split_torch_state_dict_into_shards) in stream
order: fill a file until the next tensor would tip it over `max_shard_size`; a tensor
larger than that gets a file of its own. One difference: a file is closed at such a large
tensor instead of being continued after it, because a file is written front to back while
the stream goes by (huggingface_hub holds everything and may fill a file from both sides
of it). One file is named model.safetensors and has no index, as theirs. The folder is
written beside the target and renamed at the end (`replace_folder`), so a crash never
leaves a half-written folder under the final name.

Used by both exports: models.gpt.hf.export (our GPT converted to a family's names) and
models.hf_native.export (a Hugging Face model trained as it is).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from hybrid.checkpoint.full_state import TensorLayout, write_safetensors

DEFAULT_MAX_SHARD_SIZE = "5GB"
# huggingface_hub's parse_size_to_int: decimal units only ("5GB" is 5 * 10**9 bytes).
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_shard_size(size: int | str) -> int:
    """Bytes for `max_shard_size` as save_pretrained reads it: an int, or a number with
    KB, MB, GB or TB (powers of 10: "5GB" = 5 * 10**9, "500MB", "1.5GB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        text = str(size).strip()
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]B)", text, re.IGNORECASE)
        if text.isdigit():
            value = int(text)
        elif match is None:
            raise ValueError(
                f"max shard size {size!r} cannot be read: give bytes or a number with KB, "
                "MB, GB or TB, e.g. 5GB or 500MB"
            )
        else:
            value = int(float(match[1]) * _UNITS[match[2].upper()])
    if value <= 0:
        raise ValueError(f"max shard size {size!r} must be positive, e.g. 5GB")
    return value


def plan_shards(layout: TensorLayout, max_bytes: int) -> list[TensorLayout]:
    """`layout` cut into consecutive files of at most `max_bytes` (a larger tensor alone)."""
    shards: list[TensorLayout] = []
    current: TensorLayout = []
    size = 0
    for entry in layout:
        nbytes = entry_bytes(entry)
        if current and (nbytes > max_bytes or size + nbytes > max_bytes):
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
        if nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    return shards


def entry_bytes(entry: tuple[str, tuple[int, ...], torch.dtype]) -> int:
    _, shape, dtype = entry
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def new_folder(folder: Path) -> Path:
    """The hidden folder beside `folder` that is written first (emptied if it exists)."""
    tmp = folder.parent / f".tmp-{folder.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_weights(
    tmp: Path,
    layout: TensorLayout,
    stream: Iterator[tuple[str, torch.Tensor]],
    max_bytes: int,
) -> None:
    """The tensors arriving from `stream` (in `layout`'s order) as safetensors files of at
    most `max_bytes` in `tmp`, with model.safetensors.index.json when there are several."""
    shards = plan_shards(layout, max_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(tmp / name, shard, _take(stream, len(shard)))
    if next(stream, None) is not None:
        raise ValueError(f"{tmp}: the stream has more tensors than the layout")
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(torch.Size(s).numel() for _, s, _ in layout),
                "total_size": sum(entry_bytes(entry) for entry in layout),
            },
            "weight_map": {e[0]: n for n, shard in zip(names, shards, strict=True) for e in shard},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (tmp / "model.safetensors.index.json").write_text(text)


def _take(stream: Iterator[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for _ in range(n):
        item = next(stream, None)
        if item is None:
            return
        yield item
        del item  # before the next tensor is produced


def replace_folder(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; an older folder of that name is moved aside
    first and deleted only once the new one is there."""
    old = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
