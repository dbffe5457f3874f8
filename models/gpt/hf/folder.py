"""Hugging Face checkpoints in and out: GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM).

Nothing here touches the network: folders are read and written locally.

    config, weights = read_hf_folder("path/to/checkpoint")  # full tensors, our names
    model = GPT(config, tp, init_weights=weights)  # each rank keeps its TP slice
    model = GPT(config, tp, device="meta", init_weights=weights)  # the Engine materialises

    weights = open_hf_weights(folder, read_hf_config(folder))  # lazy: hf_files.py
    model = GPT(config, tp, device="meta", init_weights=weights)  # reads only each shard

    full = dict(named_full_tensors(model, model.tp.group))  # every TP rank calls this
    write_hf_folder("out", full, model.config)  # one rank; from_pretrained("out") loads it

Layouts (ours are in models/gpt/attention.py and mlp.py):
- GPT-2's Conv1D weights are transposed and its [q | k | v] reordered into our QKV layout;
  Llama's q, k, v and gate, up projections are fused (hf_layouts.py). Llama's rotary
  embedding rotates half-split pairs (rotate_half), as ours does, so q and k weights are
  copied unpermuted.
- The vocabulary stays exactly the checkpoint's (not padded to a multiple of 128); the
  vocabulary-parallel layers pad locally when it does not divide by tp and the loss masks
  the padding (GPT's n_real_tokens defaults to vocab_size).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.gpt.config import GPTConfig
from models.gpt.hf.bin import load_bin
from models.gpt.hf.families import config_from_hf, family_of, hf_config
from models.gpt.hf.layouts import PREFIX, Reader, import_all, standalone, to_hf
from models.gpt.hf.lazy import open_hf_weights
from models.gpt.hf.weight_files import weight_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "config_from_hf",
    "hf_to_ours",
    "ours_to_hf",
    "read_hf_config",
    "read_hf_folder",
    "read_hf_weights",
    "write_hf_folder",
]

Tensor = torch.Tensor


def hf_to_ours(hf_state: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Full (tp=1) tensors under our parameter names from a Hugging Face state dict
    (with or without the `transformer.` / `model.` prefix of the *ForCausalLM classes).
    A tensor left over that is neither a known buffer nor a tied output is an error."""
    family = family_of(config)
    return import_all(family, Reader(hf_state, prefix=PREFIX[family]), config)


def ours_to_hf(
    full_state: Mapping[str, Tensor], config: GPTConfig
) -> tuple[dict[str, Tensor], PretrainedConfig]:
    """The Hugging Face state dict (contiguous tensors, GPT2LMHeadModel or
    LlamaForCausalLM names; a tied output layer is left out, as save_pretrained does) and
    config for our full (tp=1) tensors. ValueError when no Hugging Face class matches."""
    family = family_of(config)
    state = to_hf(family, full_state, config)
    if not config.tie_embeddings:
        state["lm_head.weight"] = full_state["lm_head.weight"]
    return {k: standalone(v) for k, v in state.items()}, hf_config(config)


def read_hf_folder(path: str | Path) -> tuple[GPTConfig, dict[str, Tensor]]:
    """Our config and full tensors (our names) from a local Hugging Face checkpoint folder:
    config.json plus model.safetensors, sharded safetensors with
    model.safetensors.index.json, or, only when there is no safetensors file,
    pytorch_model.bin (read with torch.load(weights_only=True): no code runs).
    FileNotFoundError or ValueError naming the file for a missing or unreadable one."""
    config = read_hf_config(path)
    return config, hf_to_ours(read_hf_weights(path), config)


def read_hf_config(path: str | Path) -> GPTConfig:
    """Our config from a checkpoint folder's config.json, after checking the folder's
    weights against it from the file headers (hf_files.open_hf_weights: every shard there,
    every tensor's name and shape; nothing large is read): the checks a job runs on every
    rank before it starts."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: not a folder; expected a Hugging Face checkpoint folder with "
            "config.json and model.safetensors"
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a Hugging Face checkpoint needs it")
    # Imported here: the Auto classes import every model's mapping (seconds of start-up
    # for runs that read no Hugging Face folder).
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{config_file}: not a readable Hugging Face config ({error})") from error
    try:
        config = config_from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None
    open_hf_weights(folder, config)
    return config


def read_hf_weights(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder under its Hugging Face name, all read (the
    eager path; a job reads lazily: hf_files.open_hf_weights). The files looked for, in
    order, are hf_files.weight_files'; a pickle is unpickled with weights_only=True."""
    where, files, weight_map = weight_files(Path(folder))
    load = load_bin if files[0].suffix == ".bin" else _load_safetensors
    state: dict[str, Tensor] = {}
    for file in files:
        state |= load(file)
    missing = sorted((weight_map or {}).keys() - state.keys())
    if missing:
        raise ValueError(f"{where}: tensors listed but not in their shard files: {missing[:5]}")
    return state


def write_hf_folder(path: str | Path, full_state: Mapping[str, Tensor], config: GPTConfig) -> Path:
    """Write config.json and model.safetensors (save_pretrained's layout) for our full
    tensors; `from_pretrained(path)` of the matching Hugging Face class loads them."""
    folder = Path(path)
    state, hf_config = ours_to_hf(full_state, config)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(folder))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from error
