"""A Hugging Face causal LM trained as it is (any AutoModelForCausalLM: Qwen2, Mistral,
Phi-3, Gemma, ...), with the interface the training loop drives our GPT through:
`model(inputs, targets, loss_tokens)` is the loss, `model(inputs)` the logits, `blocks`
the units the Engine buckets, `initial_values` a meta parameter's values (read lazily
from the folder, or drawn by the model's own init: hybrid.wrap.MetaInit).

The model is built on the meta device from the folder's config.json; the Engine then
materialises each rank's shard only. Parameter names are the Hugging Face model's under
`hf.` (so the export strips it). Tensor parallelism needs our layers: tp=1 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.wrap import MetaInit, find_units
from hybrid.wrap.units import recompute_units
from models.hf_native.weights import SafetensorsValues

IGNORE_INDEX = -100  # a target not counted in the loss: torch's default, models.gpt's too
PREFIX = "hf."


@dataclass(frozen=True)
class HFModelInfo:
    """The shape of the model, for the run's banner, the planner and the check that a
    checkpoint holds this model (compared field by field on resume)."""

    model_type: str
    n_layer: int
    d_model: int
    n_head: int
    kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool


def model_info(config: Any) -> HFModelInfo:
    heads = config.num_attention_heads
    return HFModelInfo(
        model_type=config.model_type,
        n_layer=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_head=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        ffn_dim=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        vocab_size=config.vocab_size,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def read_hf_config(folder: str | Path) -> Any:
    """The folder's transformers config (config.json, no download)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def build_on_meta(hf_config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def units_of(hf: nn.Module) -> list[nn.Module]:
    """The decoder layers and, when they are not tied, the token embedding before them and
    the output layer after them, each a unit of its own: a large vocabulary's tables (Qwen2:
    152k x 3584, twice) are then gathered at ZeRO-3 only around their own use, not for the
    whole step as bucket 0 is. Tied, the one table is shared by two modules and stays in
    bucket 0 (hybrid.zero.bucket lays out a parameter two units share once, there)."""
    layers = find_units(hf)
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if head is None or head.weight is embedding.weight:
        return layers
    return [embedding, *layers, head]


class HFCausalLM(nn.Module):
    def __init__(
        self,
        folder: str | Path,
        read_weights: bool = True,
        recompute: bool = False,
        buffers_on: torch.device | None = None,
    ) -> None:
        """The model of `folder` on meta; its values are the folder's weights (or, with
        `read_weights=False`, e.g. when a checkpoint replaces them, the model's own init).
        `recompute`: full recomputation of every layer (hybrid.wrap.units)."""
        super().__init__()
        self.hf_config = read_hf_config(folder)
        self.hf = build_on_meta(self.hf_config)
        self.config = model_info(self.hf_config)
        self.units = units_of(self.hf)  # a plain list: not registered a second time
        if recompute:  # the layers: an embedding's lookup or the logits are not worth it
            recompute_units(find_units(self.hf))
        # The model's own init fills the buffers (rotary frequencies) and, unless the
        # weights are read, the parameters; recording it on meta costs nothing.
        self._values: Any = MetaInit(self.hf, buffers_on or torch.device("cpu"))
        if read_weights:
            shapes = {name: tuple(p.shape) for name, p in self.hf.named_parameters()}
            self._values = SafetensorsValues(folder, shapes)

    @property
    def blocks(self) -> list[nn.Module]:
        return self.units

    def initial_values(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._values.initial_values(name.removeprefix(PREFIX), start, end)

    def initial_value(self, name: str) -> torch.Tensor:
        return self._values.initial_value(name.removeprefix(PREFIX))

    def forget_initial_weights(self) -> None:
        self._values = None

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_tokens: float | torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Without `targets`: the logits. With them: the cross-entropy summed over targets
        that are not IGNORE_INDEX, divided by `loss_tokens` (default: their count). The
        targets are already shifted (the loop cuts each window into inputs and next
        tokens), so the model is not given labels."""
        if segments is not None:
            raise ValueError("packed examples need segment masks, which this model lacks")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # fmt: skip
        if loss_tokens is None:
            loss_tokens = (targets != IGNORE_INDEX).sum().clamp(min=1)
        return loss / loss_tokens

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`tokens` tokens sampled after `idx`, the whole sequence run each time (no
        cache: a sample at the end of a run, not a server)."""
        for _ in range(tokens):
            logits = self(idx)[:, -1, :].float() / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
