"""pytorch_model.bin checkpoints: unpickled with weights_only=True (only tensors and plain
containers: a malicious file cannot run code), memory-mapped with torch.load(mmap=True),
and converted once to sharded safetensors (`bin_to_safetensors`).

A pickle cannot be opened per read as a safetensors file is (hf_files), so its pages stay
mapped for the whole import and count in the rank's resident memory: beyond
BIN_LIMIT_BYTES the import refuses it, with the command that converts it.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.gpt.hf.layouts import standalone
from models.gpt.hf.weight_files import weight_files

Tensor = torch.Tensor

# pytorch_model.bin files above this (all shards together) are refused: 2 GiB of mapped
# pages per rank is the most an import should add on top of the rank's share.
BIN_LIMIT_BYTES = 2 << 30
CONVERT_COMMAND = "python -m launch.convert --bin-to-safetensors {folder} --out <new folder>"


def load_bin(file: Path) -> dict[str, Tensor]:
    """A pickled state dict, memory-mapped, unpickled with weights_only=True: only tensors
    and plain containers are accepted, so a malicious file cannot run code."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:  # the legacy (pre zip) format cannot be mapped
            if "mmap" not in str(error):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        why = next((line for line in lines if "WeightsUnpickler error" in line), lines[0])
        raise ValueError(
            f"{file}: not a readable PyTorch state dict under torch.load(weights_only=True), "
            f"which runs no code ({why})"
        ) from error
    if not isinstance(state, Mapping) or not all(isinstance(t, Tensor) for t in state.values()):
        raise ValueError(f"{file}: expected a mapping of names to tensors")
    return dict(state)


def check_bin_size(folder: Path, files: list[Path]) -> None:
    """Refuse pickles above BIN_LIMIT_BYTES, naming the command that converts them."""
    size = sum(f.stat().st_size for f in files)
    if size > BIN_LIMIT_BYTES:
        raise ValueError(
            f"{files[0]}: {size / 2**30:.1f} GiB of pickled weights cannot be read in slices "
            f"(the limit is {BIN_LIMIT_BYTES / 2**30:.0f} GiB); convert the folder once: "
            + CONVERT_COMMAND.format(folder=folder)
        )


def bin_to_safetensors(folder: str | Path, out: str | Path, shard_bytes: int = 2 << 30) -> Path:
    """Rewrite a pytorch_model.bin folder as sharded safetensors (model-0000k-of-0000n
    files of at most `shard_bytes`, unless one tensor is larger, plus
    model.safetensors.index.json), tensor by tensor from the memory-mapped pickle; the
    other files (config.json, the tokenizer) are copied. Returns `out`."""
    folder, out = Path(folder), Path(out)
    where, files, _ = weight_files(folder)
    if files[0].suffix != ".bin":
        raise ValueError(f"{where}: already safetensors; nothing to convert")
    groups: list[tuple[Path, list[str]]] = []  # (bin file, keys) per output shard
    for file in files:
        size, keys = 0, []
        for key, tensor in load_bin(file).items():
            if keys and size + tensor.nbytes > shard_bytes:
                groups.append((file, keys))
                size, keys = 0, []
            size, keys = size + tensor.nbytes, [*keys, key]
        if keys:
            groups.append((file, keys))
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, (file, keys) in enumerate(groups, 1):
        state = load_bin(file)  # mapped afresh: pages of earlier shards are let go
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        seen: set[int] = set()
        shard = {}
        for key in keys:  # tensors sharing storage (tied weights) are written apart
            tensor = state[key]
            ptr = tensor.untyped_storage().data_ptr()
            shard[key] = tensor.clone() if ptr in seen else standalone(tensor)
            seen.add(ptr)
        save_file(shard, str(out / name), metadata={"format": "pt"})
        total += sum(t.nbytes for t in shard.values())
        weight_map |= dict.fromkeys(keys, name)
        del state, shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    weights = {"pytorch_model.bin", "pytorch_model.bin.index.json", *(f.name for f in files)}
    for path in folder.iterdir():
        if path.is_file() and path.name not in weights:
            shutil.copy2(path, out / path.name)
    return out
