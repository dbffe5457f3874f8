"""Closed-form parameter and FLOP counts for the GPT in `model.py`."""

from __future__ import annotations

from .config import GPTConfig


def count_parameters(config: GPTConfig) -> int:
    """Exact number of trainable parameters (input and output embeddings are tied).

    Per layer: two LayerNorms (4h), QKV (3h^2 + 3h), attention output (h^2 + h),
    MLP up (4h^2 + 4h) and down (4h^2 + h): 12h^2 + 13h. Plus token (V h) and position
    (S h) embeddings and the final LayerNorm (2h).
    """
    h, vocab = config.d_model, _vocab(config)
    per_layer = 12 * h * h + 13 * h
    return vocab * h + config.seq_len * h + config.n_layer * per_layer + 2 * h


def flops_per_token(config: GPTConfig, full_recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward), as Megatron-LM counts them.

    Narayanan et al. 2021 (arXiv 2104.04473, eq. 3): 72 B s l h^2 (1 + s/6h + V/12lh) per
    iteration of B sequences, i.e. per token 3 x (24 l h^2 GEMMs + 4 l h s attention scores
    and values) + 3 x 2 V h logits; backward costs twice the forward. Full recomputation
    re-runs the layers' forward once more (96 instead of 72), not the logits.
    """
    h, s, layers, vocab = config.d_model, config.seq_len, config.n_layer, _vocab(config)
    layer_forward = 24 * layers * h * h + 4 * layers * h * s
    logits_forward = 2 * vocab * h
    passes = 4 if full_recompute else 3
    return passes * layer_forward + 3 * logits_forward


def _vocab(config: GPTConfig) -> int:
    if config.vocab_size is None:
        raise ValueError("model.vocab_size is not set yet: resolve it from the tokenizer first")
    return config.vocab_size
