"""Tensor layouts between Hugging Face GPT-2 / Llama state dicts and our parameters
(models.gpt.hf.folder has the public functions and the file handling).

- GPT-2 stores Linear layers as Conv1D, weight (in, out): transposed. Its c_attn output is
  [q | k | v], each (head, head_dim); ours is (head, q|k|v, head_dim) (attention.py).
- Llama's q_proj, k_proj, v_proj become one QKV in (kv_head, [q_1 .. q_g, k, v], head_dim);
  gate_proj and up_proj one fc with interleaved (feature, gate|up) rows (mlp.py).

One table (`links`) names every tensor of each family once, with both directions; the
export (export.py) and the eager and lazy imports all read it. The import direction runs
against a Reader: the eager import (folder.hf_to_ours) runs it on tensors, the lazy one
(lazy.py) on row ids, to learn where each of our rows
lives in the files. So every operation on what a Reader hands out works along dim 0 only
(chunk, unflatten, cat, stack, flatten); a transposed (Conv1D) tensor is asked for with
`take_transposed`, whose dim 0 is the stored tensor's dim 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Link:
    """One tensor of ours and the Hugging Face tensors it is made of (one, or q/k/v, or
    gate/up), with both directions: `part(ours, i)` is Hugging Face tensor `hf[i]`, and
    `join(*hf_tensors)` is ours, from the stored tensors, transposed first when
    `transposed` (GPT-2's Conv1D keeps weights (in, out)). `join` works along dim 0 only
    (see the module doc)."""

    ours: str
    hf: tuple[str, ...]
    part: Callable[[Tensor, int], Tensor]
    join: Callable[..., Tensor]
    transposed: bool = False


def _same(t: Tensor, i: int = 0) -> Tensor:
    return t


def _transposed(t: Tensor, i: int = 0) -> Tensor:
    return t.t()


def _one(ours: str, hf: str, conv1d: bool = False) -> Link:
    """A tensor stored as it is, or transposed (a Conv1D weight)."""
    return Link(ours, (hf,), _transposed if conv1d else _same, _same, transposed=conv1d)


def _gpt2_links(config: GPTConfig) -> list[Link]:
    """GPT2LMHeadModel's tensors (no prefix) in save_pretrained's order."""

    def c_attn(t: Tensor, i: int) -> Tensor:  # our QKV -> rows [q | k | v]
        return torch.cat(_split_qkv(t, config))

    links = [_one("wte.weight", "wte.weight"), _one("wpe.weight", "wpe.weight")]
    for i in range(config.n_layer):
        ours, hf = f"blocks.{i}.", f"h.{i}."
        links += [
            _one(ours + "ln_1.weight", hf + "ln_1.weight"),
            _one(ours + "ln_1.bias", hf + "ln_1.bias"),
            Link(ours + "attn.qkv.weight", (hf + "attn.c_attn.weight",),
                 lambda t, i: c_attn(t, i).t(),
                 lambda w: _fuse_qkv(*w.chunk(3), config), transposed=True),
            Link(ours + "attn.qkv.bias", (hf + "attn.c_attn.bias",),
                 c_attn, lambda b: _fuse_qkv(*b.chunk(3), config)),
            _one(ours + "attn.proj.weight", hf + "attn.c_proj.weight", conv1d=True),
            _one(ours + "attn.proj.bias", hf + "attn.c_proj.bias"),
            _one(ours + "ln_2.weight", hf + "ln_2.weight"),
            _one(ours + "ln_2.bias", hf + "ln_2.bias"),
            _one(ours + "mlp.fc.weight", hf + "mlp.c_fc.weight", conv1d=True),
            _one(ours + "mlp.fc.bias", hf + "mlp.c_fc.bias"),
            _one(ours + "mlp.proj.weight", hf + "mlp.c_proj.weight", conv1d=True),
            _one(ours + "mlp.proj.bias", hf + "mlp.c_proj.bias"),
        ]  # fmt: skip
    return [*links, _one("ln_f.weight", "ln_f.weight"), _one("ln_f.bias", "ln_f.bias")]


def _llama_links(config: GPTConfig) -> list[Link]:
    """LlamaForCausalLM's tensors (no prefix) in save_pretrained's order."""

    def qkv_part(t: Tensor, i: int) -> Tensor:
        return _split_qkv(t, config)[i]

    def gate_up_part(t: Tensor, i: int) -> Tensor:  # our fc interleaves (feature, gate|up)
        return t.unflatten(0, (-1, 2))[:, i]

    links = [_one("wte.weight", "embed_tokens.weight")]
    for i in range(config.n_layer):
        ours, hf = f"blocks.{i}.", f"layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        links += [
            Link(ours + "attn.qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
                 qkv_part, lambda q, k, v: _fuse_qkv(q, k, v, config)),
            _one(ours + "attn.proj.weight", attn + "o_proj.weight"),
            Link(ours + "mlp.fc.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                 gate_up_part, lambda gate, up: torch.stack([gate, up], dim=1).flatten(0, 1)),
            _one(ours + "mlp.proj.weight", mlp + "down_proj.weight"),
            _one(ours + "ln_1.weight", hf + "input_layernorm.weight"),
            _one(ours + "ln_2.weight", hf + "post_attention_layernorm.weight"),
        ]  # fmt: skip
    return [*links, _one("ln_f.weight", "norm.weight")]


def links(family: str, config: GPTConfig) -> list[Link]:
    """Every tensor of a `family` ("gpt2" or "llama") model but the output layer, in
    save_pretrained's order: the one name table both directions use."""
    return (_gpt2_links if family == "gpt2" else _llama_links)(config)


def to_ours(family: str, reader: Reader, config: GPTConfig) -> dict[str, Tensor]:
    """Our full tensors from a checkpoint of `family`."""
    out = {}
    for link in links(family, config):
        take = reader.take_transposed if link.transposed else reader.take
        out[link.ours] = link.join(*map(take, link.hf))
    return out


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
    prefix = PREFIX[family]
    return {
        prefix + name: link.part(full[link.ours], i)
        for link in links(family, config)
        for i, name in enumerate(link.hf)
    }


def standalone(tensor: Tensor) -> Tensor:
    """The tensor, copied unless it is contiguous and alone in its storage: safetensors
    refuses tensors that share memory (views such as q, k, v of one QKV)."""
    alone = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
    if tensor.is_contiguous() and alone:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
