"""Tiny random Hugging Face models built offline from their configs (no download), each
with a batch and a loss: three causal LMs of different families and a vision classifier.

- qwen2: attention biases (q, k, v), grouped-query attention, tied embeddings;
- mistral: untied output layer, grouped-query attention;
- phi3: fused QKV and gate|up projections;
- vit: patch embeddings, a CLS token and position embeddings, a classification head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 4
LM = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip


def config(kind: str, layers: int = LM["num_hidden_layers"]) -> object:
    import transformers as tf

    lm = LM | {"num_hidden_layers": layers}
    if kind == "qwen2":
        return tf.Qwen2Config(**lm, tie_word_embeddings=True)
    if kind == "mistral":
        return tf.MistralConfig(**lm, tie_word_embeddings=False)
    if kind == "phi3":
        return tf.Phi3Config(**lm, tie_word_embeddings=False, pad_token_id=0)
    if kind == "vit":
        return tf.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=layers,
            num_attention_heads=4, intermediate_size=64, num_labels=3,
        )  # fmt: skip
    raise ValueError(kind)


def build(kind: str, device: str = "cpu", seed: int = 0, layers: int = 3) -> nn.Module:
    """The model with random weights drawn from `seed` (on meta: shapes only)."""
    import transformers as tf

    torch.manual_seed(seed)
    with torch.device(device):
        if kind == "vit":
            model = tf.ViTForImageClassification(config(kind, layers))
        else:
            model = tf.AutoModelForCausalLM.from_config(config(kind, layers))
    return model


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (GLOBAL_BATCH rows): (inputs, labels)."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "vit":
        images = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g)
        return images, torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, ids


def loss_of(kind: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean loss of a batch: next-token cross-entropy (the model shifts the labels), or
    the classification loss."""
    if kind == "vit":
        return lambda model, x, y: model(pixel_values=x, labels=y).loss
    return lambda model, x, y: model(input_ids=x, labels=y).loss


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW as the Engine configures it: decay on matrices only."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
