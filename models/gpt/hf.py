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
from models.gpt.hf_bin import load_bin
from models.gpt.hf_layouts import PREFIX, Reader, import_all, standalone, to_hf

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Tensor = torch.Tensor


def config_from_hf(hf_config: PretrainedConfig) -> GPTConfig:
    """Our config for a Hugging Face GPT2Config or LlamaConfig; ValueError for an option
    we do not implement (it names the field)."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        return _gpt2_config(hf_config)
    if kind == "llama":
        return _llama_config(hf_config)
    raise ValueError(f"Hugging Face model_type {kind!r} is not supported (gpt2, llama are)")


def hf_to_ours(hf_state: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Full (tp=1) tensors under our parameter names from a Hugging Face state dict
    (with or without the `transformer.` / `model.` prefix of the *ForCausalLM classes).
    A tensor left over that is neither a known buffer nor a tied output is an error."""
    family = _family(config)
    return import_all(family, Reader(hf_state, prefix=PREFIX[family]), config)


def ours_to_hf(
    full_state: Mapping[str, Tensor], config: GPTConfig
) -> tuple[dict[str, Tensor], PretrainedConfig]:
    """The Hugging Face state dict (contiguous tensors, GPT2LMHeadModel or
    LlamaForCausalLM names; a tied output layer is left out, as save_pretrained does) and
    config for our full (tp=1) tensors. ValueError when no Hugging Face class matches."""
    family = _family(config)
    state = to_hf(family, full_state, config)
    hf_config = _gpt2_hf_config(config) if family == "gpt2" else _llama_hf_config(config)
    if not config.tie_embeddings:
        state["lm_head.weight"] = full_state["lm_head.weight"]
    return {k: standalone(v) for k, v in state.items()}, hf_config


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
    from models.gpt.hf_files import open_hf_weights  # here: it imports this module

    open_hf_weights(folder, config)
    return config


def read_hf_weights(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder under its Hugging Face name, all read (the
    eager path; a job reads lazily: hf_files.open_hf_weights). The files looked for, in
    order, are hf_files.weight_files'; a pickle is unpickled with weights_only=True."""
    from models.gpt.hf_files import weight_files  # here: it imports this module

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


# -- families ---------------------------------------------------------------------------


def _family(config: GPTConfig) -> str:
    """The Hugging Face family (gpt2 or llama) whose architecture this config describes."""
    options = (config.norm, config.mlp, config.positions, config.bias)
    if options == ("layernorm", "gelu", "learned", True) and config.kv_heads == config.n_head:
        return "gpt2"
    if options == ("rmsnorm", "swiglu", "rope", False):
        return "llama"
    raise ValueError(
        f"no Hugging Face class matches norm={config.norm}, mlp={config.mlp}, "
        f"positions={config.positions}, bias={config.bias}, n_kv_head={config.kv_heads}: "
        "GPT-2 is layernorm/gelu/learned/bias, Llama is rmsnorm/swiglu/rope/no bias"
    )


def _gpt2_config(hf: PretrainedConfig) -> GPTConfig:
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"GPT-2 activation_function={hf.activation_function!r} is not supported; "
            "ours is the tanh GELU (gelu_new)"
        )
    for field, wanted in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if getattr(hf, field, wanted) != wanted:
            raise ValueError(f"GPT-2 {field}={getattr(hf, field)} is not supported")
    return GPTConfig(
        n_layer=hf.n_layer,
        n_head=hf.n_head,
        d_model=hf.n_embd,
        seq_len=hf.n_positions,
        dropout=float(hf.resid_pdrop),  # one rate for residual, embedding and attention
        vocab_size=hf.vocab_size,
        norm_eps=hf.layer_norm_epsilon,
        d_ff=hf.n_inner,
        tie_embeddings=hf.tie_word_embeddings,
    )


def _gpt2_hf_config(config: GPTConfig) -> PretrainedConfig:
    from transformers import GPT2Config  # here: its import pulls in the Auto mappings

    in_vocab = config.vocab_size is not None and config.vocab_size > 50256

    return GPT2Config.from_dict(
        {
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": config.vocab_size,
            "n_positions": config.seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.d_ff,
            "activation_function": "gelu_new",
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "layer_norm_epsilon": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            # GPT-2's <|endoftext|> is 50256; a smaller vocabulary is another tokenizer's.
            "bos_token_id": 50256 if in_vocab else None,
            "eos_token_id": 50256 if in_vocab else None,
        }
    )


def _llama_config(hf: PretrainedConfig) -> GPTConfig:
    if hf.hidden_act != "silu":
        raise ValueError(f"Llama hidden_act={hf.hidden_act!r} is not supported (silu is)")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf, field, False):
            raise ValueError(f"Llama {field}=True is not supported (biases are off)")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim not in (None, hf.hidden_size // hf.num_attention_heads):
        raise ValueError(
            f"Llama head_dim={head_dim} != hidden_size / num_attention_heads is not supported"
        )
    kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return GPTConfig(
        n_layer=hf.num_hidden_layers,
        n_head=hf.num_attention_heads,
        d_model=hf.hidden_size,
        seq_len=hf.max_position_embeddings,
        dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        vocab_size=hf.vocab_size,
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        mlp="swiglu",
        d_ff=hf.intermediate_size,
        positions="rope",
        rope_theta=_rope_theta(hf),
        n_kv_head=None if kv == hf.num_attention_heads else kv,
        tie_embeddings=hf.tie_word_embeddings,
        bias=False,
    )


def _rope_theta(hf: PretrainedConfig) -> float:
    """The rotary base; only plain RoPE (no scaling of the frequencies) is implemented.
    transformers >= 5 keeps it in `rope_parameters`, 4.x in `rope_theta`/`rope_scaling`."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"Llama rope scaling {kind!r} is not supported (plain RoPE is)")
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _llama_hf_config(config: GPTConfig) -> PretrainedConfig:
    # from_dict takes `rope_theta` in both transformers 4.x and 5.x.
    from transformers import LlamaConfig  # here: as GPT2Config

    return LlamaConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "intermediate_size": config.ffn_dim,
            "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.seq_len,
            "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta,
            "attention_dropout": config.dropout,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }
    )


# -- files ------------------------------------------------------------------------------


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from error
