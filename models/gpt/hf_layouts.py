"""Tensor layouts between Hugging Face GPT-2 / Llama state dicts and our parameters
(models.gpt.hf has the public functions and the file handling).

- GPT-2 stores Linear layers as Conv1D, weight (in, out): transposed. Its c_attn output is
  [q | k | v], each (head, head_dim); ours is (head, q|k|v, head_dim) (attention.py).
- Llama's q_proj, k_proj, v_proj become one QKV in (kv_head, [q_1 .. q_g, k, v], head_dim);
  gate_proj and up_proj one fc with interleaved (feature, gate|up) rows (mlp.py).

The import direction is written once, against a Reader: the eager import (hf.hf_to_ours)
runs it on tensors, the lazy one (hf_files) on row ids, to learn where each of our rows
lives in the files. So every operation on what a Reader hands out works along dim 0 only
(chunk, unflatten, cat, stack, flatten); a transposed (Conv1D) tensor is asked for with
`take_transposed`, whose dim 0 is the stored tensor's dim 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from models.gpt.config import GPTConfig

Tensor = torch.Tensor

# Tensors some checkpoints carry that are not parameters (causal-mask and rotary buffers).
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")

# The prefix of the *ForCausalLM classes' names (a bare GPT2Model / LlamaModel has none).
PREFIX = {"gpt2": "transformer.", "llama": "model."}


def is_buffer(name: str) -> bool:
    """A non-parameter tensor (causal mask, rotary frequencies) an import may skip."""
    return bool(_BUFFERS.search(name))


class Reader:
    """Hands out a state dict's tensors by name (prefix optional) and remembers which
    were used, so nothing is dropped silently."""

    def __init__(self, state: Mapping[str, Tensor], prefix: str) -> None:
        self.state = {k.removeprefix(prefix): v for k, v in state.items()}
        self.used: set[str] = set()

    def take(self, name: str) -> Tensor:
        if name not in self.state:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        self.used.add(name)
        return self.state[name]

    def take_transposed(self, name: str) -> Tensor:
        """A Conv1D weight, stored (in, out), as (out, in)."""
        return self.take(name).t()

    def skip(self, name: str) -> None:
        self.used.add(name)

    def check_all_used(self) -> None:
        left = sorted(k for k in self.state.keys() - self.used if not is_buffer(k))
        if left:
            raise ValueError(f"checkpoint tensors with no place in the model: {left}")


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, config: GPTConfig) -> Tensor:
    """Separate q (heads * d, ...), k and v (kv_heads * d, ...) -> our QKV layout
    (kv_head, [q_1 .. q_g, k, v], head_dim) along dim 0; weights or biases."""
    kv, d = config.kv_heads, config.head_dim
    groups = [q.unflatten(0, (kv, -1, d)), k.unflatten(0, (kv, 1, d)), v.unflatten(0, (kv, 1, d))]
    return torch.cat(groups, dim=1).flatten(0, 2)


def _split_qkv(qkv: Tensor, config: GPTConfig) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of _fuse_qkv."""
    g = config.n_head // config.kv_heads
    parts = qkv.unflatten(0, (config.kv_heads, g + 2, config.head_dim))
    return parts[:, :g].flatten(0, 2), parts[:, g].flatten(0, 1), parts[:, g + 1].flatten(0, 1)


def _per_layer(config: GPTConfig, names: Callable[[int], dict[str, str]]) -> list[tuple[str, str]]:
    return [pair for i in range(config.n_layer) for pair in names(i).items()]


def _gpt2_layer_names(i: int) -> dict[str, str]:
    """Ours -> Hugging Face GPT-2, for the tensors that map one to one (no transpose)."""
    ours, hf = f"blocks.{i}.", f"h.{i}."
    pairs = {"ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias"}
    pairs |= {"ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias"}
    pairs |= {"attn.proj.bias": "attn.c_proj.bias", "mlp.fc.bias": "mlp.c_fc.bias"}
    pairs |= {"mlp.proj.bias": "mlp.c_proj.bias"}
    return {ours + a: hf + b for a, b in pairs.items()}


def _gpt2_conv1d_names(i: int) -> dict[str, str]:
    """Ours -> Hugging Face GPT-2 for the Conv1D weights, stored (in, out)."""
    ours, hf = f"blocks.{i}.", f"h.{i}."
    pairs = {"attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    return {f"{ours}{a}.weight": f"{hf}{b}.weight" for a, b in pairs.items()}


_GPT2_TOP = {"wte.weight": "wte.weight", "wpe.weight": "wpe.weight"}
_GPT2_TOP |= {"ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}


def _gpt2_to_ours(state: Reader, config: GPTConfig) -> dict[str, Tensor]:
    ours = {a: state.take(b) for a, b in _GPT2_TOP.items()}
    ours |= {a: state.take(b) for a, b in _per_layer(config, _gpt2_layer_names)}
    ours |= {a: state.take_transposed(b) for a, b in _per_layer(config, _gpt2_conv1d_names)}
    for i in range(config.n_layer):
        weight = state.take_transposed(f"h.{i}.attn.c_attn.weight")  # rows [q | k | v]
        bias = state.take(f"h.{i}.attn.c_attn.bias")
        ours[f"blocks.{i}.attn.qkv.weight"] = _fuse_qkv(*weight.chunk(3), config)
        ours[f"blocks.{i}.attn.qkv.bias"] = _fuse_qkv(*bias.chunk(3), config)
    return ours


def _ours_to_gpt2(full: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    hf = {f"transformer.{b}": full[a] for a, b in _GPT2_TOP.items()}
    hf |= {f"transformer.{b}": full[a] for a, b in _per_layer(config, _gpt2_layer_names)}
    hf |= {f"transformer.{b}": full[a].t() for a, b in _per_layer(config, _gpt2_conv1d_names)}
    for i in range(config.n_layer):
        ours, name = f"blocks.{i}.attn.qkv", f"transformer.h.{i}.attn.c_attn"
        hf[f"{name}.weight"] = torch.cat(_split_qkv(full[f"{ours}.weight"], config)).t()
        hf[f"{name}.bias"] = torch.cat(_split_qkv(full[f"{ours}.bias"], config))
    return hf


def _llama_layer_names(i: int) -> dict[str, str]:
    """Ours -> Hugging Face Llama, for the tensors that map one to one."""
    ours, hf = f"blocks.{i}.", f"layers.{i}."
    return {
        ours + "ln_1.weight": hf + "input_layernorm.weight",
        ours + "ln_2.weight": hf + "post_attention_layernorm.weight",
        ours + "attn.proj.weight": hf + "self_attn.o_proj.weight",
        ours + "mlp.proj.weight": hf + "mlp.down_proj.weight",
    }


_LLAMA_TOP = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight"}


def _llama_to_ours(state: Reader, config: GPTConfig) -> dict[str, Tensor]:
    ours = {a: state.take(b) for a, b in _LLAMA_TOP.items()}
    ours |= {a: state.take(b) for a, b in _per_layer(config, _llama_layer_names)}
    for i in range(config.n_layer):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        q, k, v = (state.take(f"{attn}{p}_proj.weight") for p in "qkv")
        ours[f"blocks.{i}.attn.qkv.weight"] = _fuse_qkv(q, k, v, config)
        gate, up = state.take(mlp + "gate_proj.weight"), state.take(mlp + "up_proj.weight")
        ours[f"blocks.{i}.mlp.fc.weight"] = torch.stack([gate, up], dim=1).flatten(0, 1)
    return ours


def _ours_to_llama(full: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    hf = {f"model.{b}": full[a] for a, b in _LLAMA_TOP.items()}
    hf |= {f"model.{b}": full[a] for a, b in _per_layer(config, _llama_layer_names)}
    for i in range(config.n_layer):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q, k, v = _split_qkv(full[f"blocks.{i}.attn.qkv.weight"], config)
        hf |= {f"{attn}q_proj.weight": q, f"{attn}k_proj.weight": k, f"{attn}v_proj.weight": v}
        gate, up = full[f"blocks.{i}.mlp.fc.weight"].unflatten(0, (-1, 2)).unbind(1)
        hf |= {f"{mlp}gate_proj.weight": gate, f"{mlp}up_proj.weight": up}
    return hf


def to_ours(family: str, reader: Reader, config: GPTConfig) -> dict[str, Tensor]:
    """Our full tensors from a checkpoint of `family` ("gpt2" or "llama")."""
    return (_gpt2_to_ours if family == "gpt2" else _llama_to_ours)(reader, config)


def import_all(family: str, reader: Reader, config: GPTConfig) -> dict[str, Tensor]:
    """`to_ours` plus the output layer (a tied one is the embedding: a stored copy is
    skipped); a tensor left over that is neither a known buffer nor a tied output is an
    error."""
    ours = to_ours(family, reader, config)
    if config.tie_embeddings:
        reader.skip("lm_head.weight")
    else:
        ours["lm_head.weight"] = reader.take("lm_head.weight")
    reader.check_all_used()
    return ours


def to_hf(family: str, full: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """The Hugging Face tensors of `family` from our full tensors (no output layer)."""
    return (_ours_to_gpt2 if family == "gpt2" else _ours_to_llama)(full, config)


def standalone(tensor: Tensor) -> Tensor:
    """The tensor, copied unless it is contiguous and alone in its storage: safetensors
    refuses tensors that share memory (views such as q, k, v of one QKV)."""
    alone = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
    if tensor.is_contiguous() and alone:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
