"""A Hugging Face folder (config.json, sharded safetensors, model.safetensors.index.json)
written from a stream of our full (tp=1) tensors, one tensor at a time.

    layout = [(name, shape, dtype), ...]  # our tensors, in the order the stream yields them
    write_hf_export("out", config, layout, stream, max_shard_size="5GB")

A 70B model is 280 GB in fp32: no process may hold it, so nothing here collects a state
dict. Each of our tensors is converted on its own (layouts.py's one table: GPT-2's Conv1D
transposes, our QKV -> c_attn or q/k/v, our fc -> gate/up) and written before the next
arrives. What goes in which file is decided up front from the layout (names, shapes and
dtypes are known before any byte is), and each file is streamed by
hybrid.checkpoint.full_state.write_safetensors, header first.

Shards follow save_pretrained's rule (huggingface_hub's split_torch_state_dict_into_shards)
in stream order: fill a file until the next tensor would tip it over `max_shard_size`; a
tensor larger than that gets a file of its own. One difference: a file is closed at such
a large tensor instead of being continued after it, because a file is written front to
back while the stream goes by (huggingface_hub holds everything and may fill a file from
both sides of it). One file is named model.safetensors and has no index, as theirs.
Everything is written into a hidden folder beside the target and renamed at the end, so
a crash never leaves a half-written folder under the final name.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.full_state import SAFETENSORS_DTYPES, TensorLayout, write_safetensors
from models.gpt.config import GPTConfig
from models.gpt.hf import families
from models.gpt.hf.families import family_of
from models.gpt.hf.layouts import PREFIX, links

Tensor = torch.Tensor

DEFAULT_MAX_SHARD_SIZE = "5GB"
# huggingface_hub's parse_size_to_int: decimal units only ("5GB" is 5 * 10**9 bytes).
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: its name, the one tensor of ours it comes from, and the
    conversion (our full tensor -> this tensor, possibly a view)."""

    name: str
    source: str
    convert: Callable[[Tensor], Tensor]


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


def hf_tensors(config: GPTConfig) -> list[HFTensor]:
    """Every tensor save_pretrained writes for `config`, in its order (a tied output layer
    is left out, as save_pretrained leaves it out). ValueError when no class matches."""
    name = family_of(config)
    out = [
        HFTensor(PREFIX[name] + hf, link.ours, functools.partial(link.part, i=i))
        for link in links(name, config)
        for i, hf in enumerate(link.hf)
    ]
    if not config.tie_embeddings:
        out.append(HFTensor("lm_head.weight", "lm_head.weight", lambda t: t))
    return out


def source_order(config: GPTConfig) -> list[str]:
    """Our tensor names in the order that makes the Hugging Face tensors come out in
    save_pretrained's order (each name once)."""
    return list(dict.fromkeys(t.source for t in hf_tensors(config)))


def hf_layout(config: GPTConfig, layout: TensorLayout, dtype: torch.dtype | None) -> TensorLayout:
    """(Hugging Face name, shape, dtype) of every output tensor, in the order they come
    from a stream of our tensors in `layout`'s order; shapes from converting meta tensors.
    ValueError naming a tensor of ours with no place, or one missing."""
    by_source: dict[str, list[HFTensor]] = {}
    for tensor in hf_tensors(config):
        by_source.setdefault(tensor.source, []).append(tensor)
    names = [name for name, _, _ in layout]
    extra = sorted(set(names) - by_source.keys())
    missing = sorted(by_source.keys() - set(names))
    if extra or missing or len(set(names)) != len(names):
        raise ValueError(
            f"the tensors do not fit a Hugging Face {family_of(config)} model of this config: "
            f"unexpected {extra[:3]}, missing {missing[:3]}"
        )
    out = []
    for name, shape, source_dtype in layout:
        meta = torch.empty(shape, dtype=source_dtype, device="meta")
        for tensor in by_source[name]:
            out.append((tensor.name, tuple(tensor.convert(meta).shape), dtype or source_dtype))
    return out


def plan_shards(layout: TensorLayout, max_bytes: int) -> list[TensorLayout]:
    """`layout` cut into consecutive files of at most `max_bytes` (a larger tensor alone)."""
    shards: list[TensorLayout] = []
    current: TensorLayout = []
    size = 0
    for entry in layout:
        nbytes = _nbytes(entry)
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


def _nbytes(entry: tuple[str, tuple[int, ...], torch.dtype]) -> int:
    _, shape, dtype = entry
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def write_hf_export(
    path: str | Path,
    config: GPTConfig,
    layout: TensorLayout,
    tensors: Iterable[tuple[str, Tensor]],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a Hugging Face folder for our full tensors arriving from `tensors` in
    `layout`'s order (names, tp=1 shapes, dtypes), converting each to `dtype` (default:
    its own). `extra_files(folder)` may add files (a tokenizer) before the folder takes
    its final name. Holds one tensor of ours and what is converted from it at a time."""
    folder = Path(path)
    max_bytes = parse_shard_size(max_shard_size)
    if dtype is not None and dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors")
    out_layout = hf_layout(config, layout, dtype)
    shards = plan_shards(out_layout, max_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    hf_config = families.hf_config(config)
    hf_config.dtype = dtype or layout[0][2]
    tmp = folder.parent / f".tmp-{folder.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf_config.save_pretrained(str(tmp))
    stream = _converted(config, layout, tensors, dtype)
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(tmp / name, shard, _take(stream, len(shard)))
    if next(stream, None) is not None:
        raise ValueError(f"{folder}: the stream has more tensors than the layout")
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(torch.Size(s).numel() for _, s, _ in out_layout),
                "total_size": sum(_nbytes(entry) for entry in out_layout),
            },
            "weight_map": {e[0]: n for n, shard in zip(names, shards, strict=True) for e in shard},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (tmp / "model.safetensors.index.json").write_text(text)
    if extra_files is not None:
        extra_files(tmp)
    _replace(tmp, folder)
    return folder


def _take(stream: Iterator[tuple[str, Tensor]], n: int) -> Iterator[tuple[str, Tensor]]:
    for _ in range(n):
        item = next(stream, None)
        if item is None:
            return
        yield item
        del item  # before the next tensor is produced


def _converted(
    config: GPTConfig,
    layout: TensorLayout,
    tensors: Iterable[tuple[str, Tensor]],
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, Tensor]]:
    """The Hugging Face tensors, converted from each of ours as it arrives. References
    are dropped as soon as a tensor has been written, so that at most one tensor of ours
    and one converted tensor are alive."""
    by_source: dict[str, list[HFTensor]] = {}
    for tensor in hf_tensors(config):
        by_source.setdefault(tensor.source, []).append(tensor)
    expected = iter(layout)
    for name, ours in tensors:
        want = next(expected, None)
        if want is None or (name, tuple(ours.shape)) != (want[0], tuple(want[1])):
            got = (name, tuple(ours.shape))
            raise ValueError(f"tensor {got} arrived where the layout has {want}")
        parts = by_source[name]
        for i, part in enumerate(parts):
            converted = part.convert(ours)
            if dtype is not None:
                converted = converted.to(dtype)
            if i == len(parts) - 1:
                del ours  # a copy (a transpose, a cat) need not live beside its source
            yield part.name, converted
            del converted


def _replace(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; an older folder of that name is moved aside
    first and deleted only once the new one is there."""
    old = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
