"""A Hugging Face model trained as it is, written back as a folder `from_pretrained`
loads: its config.json and its tensors under their own names (the `hf.` of
models.hf_native.causal_lm stripped), sharded safetensors streamed one tensor at a time
(models.hf_native.sharded_folder). A tied output layer is one tensor, left out as
save_pretrained leaves it out; the config's tie_word_embeddings ties it again on load."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hybrid.checkpoint.full_state import TensorLayout
from models.hf_native.causal_lm import PREFIX
from models.hf_native.sharded_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    new_folder,
    parse_shard_size,
    replace_folder,
    write_weights,
)


def write_native_export(
    path: str | Path,
    hf_config: Any,
    layout: TensorLayout,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write the folder from full tensors arriving in `layout`'s order (our names)."""
    folder = Path(path)
    max_bytes = parse_shard_size(max_shard_size)
    tmp = new_folder(folder)
    hf_config.dtype = layout[0][2]
    hf_config.save_pretrained(str(tmp))
    renamed = [(name.removeprefix(PREFIX), shape, dtype) for name, shape, dtype in layout]
    write_weights(tmp, renamed, _renamed(tensors), max_bytes)
    if extra_files is not None:
        extra_files(tmp)
    replace_folder(tmp, folder)
    return folder


def _renamed(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name.removeprefix(PREFIX), tensor
