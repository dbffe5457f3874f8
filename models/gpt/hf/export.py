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

Shards and the folder's atomic rename: models.hf_native.sharded_folder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.full_state import SAFETENSORS_DTYPES, TensorLayout
from models.gpt.config import GPTConfig
from models.gpt.hf import families
from models.gpt.hf.families import family_of
from models.gpt.hf.layouts import PREFIX, links
from models.hf_native.sharded_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    new_folder,
    parse_shard_size,
    replace_folder,
    write_weights,
)

Tensor = torch.Tensor

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "parse_shard_size", "source_order", "write_hf_export"]


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: its name, the one tensor of ours it comes from, and the
    conversion (our full tensor -> this tensor, possibly a view)."""

    name: str
    source: str
    convert: Callable[[Tensor], Tensor]


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
    hf_config = families.hf_config(config)
    hf_config.dtype = dtype or layout[0][2]
    tmp = new_folder(folder)
    hf_config.save_pretrained(str(tmp))
    write_weights(tmp, out_layout, _converted(config, layout, tensors, dtype), max_bytes)
    if extra_files is not None:
        extra_files(tmp)
    replace_folder(tmp, folder)
    return folder


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
