"""Closed-form parameter and FLOP counts for the GPT in `model.py`."""

from __future__ import annotations

from .config import GPTConfig


def count_parameters(config: GPTConfig) -> int:
    """Exact number of trainable parameters (the vocabulary as configured, padding included).

    GPT-2 per layer: two LayerNorms (4h), QKV (3h^2 + 3h), attention output (h^2 + h),
    MLP up (4h^2 + 4h) and down (4h^2 + h): 12h^2 + 13h. Plus token (V h) and position
    (S h) embeddings and the final LayerNorm (2h); the output layer is tied.
    The options change the terms: RMSNorm (and LayerNorm without bias) has h parameters;
    grouped-query attention's QKV has (a + 2 a_kv) d_head outputs; SwiGLU has two input
    matrices of width d_ff; rotary positions have none; an untied output layer adds V h.
    """
    h, vocab = config.d_model, _vocab(config)
    per_layer = 2 * _norm(config) + _layer_matrices(config) + _layer_biases(config)
    total = vocab * h + config.n_layer * per_layer + _norm(config)
    if config.positions == "learned":
        total += config.seq_len * h
    if not config.tie_embeddings:
        total += vocab * h
    return total


def flops_per_token(config: GPTConfig, full_recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward), as Megatron-LM counts them.

    Narayanan et al. 2021 (arXiv 2104.04473, eq. 3): 72 B s l h^2 (1 + s/6h + V/12lh) per
    iteration of B sequences, i.e. per token 3 x (24 l h^2 GEMMs + 4 l h s attention scores
    and values) + 3 x 2 V h logits; backward costs twice the forward. Full recomputation
    re-runs the layers' forward once more (96 instead of 72), not the logits. For the
    Llama options the 24 h^2 is 2 x the layer's matrix parameters (12 h^2 for GPT-2).
    """
    h, s, layers, vocab = config.d_model, config.seq_len, config.n_layer, _vocab(config)
    layer_forward = 2 * layers * _layer_matrices(config) + 4 * layers * h * s
    logits_forward = 2 * vocab * h
    passes = 4 if full_recompute else 3
    return passes * layer_forward + 3 * logits_forward


def _layer_matrices(config: GPTConfig) -> int:
    """Weight-matrix parameters of one transformer layer."""
    h, heads = config.d_model, config.n_head * config.head_dim
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    mlp_inputs = 2 if config.mlp == "swiglu" else 1
    return h * qkv + heads * h + (mlp_inputs + 1) * h * config.ffn_dim


def _layer_biases(config: GPTConfig) -> int:
    if not config.bias:
        return 0
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    mlp_inputs = 2 if config.mlp == "swiglu" else 1
    return qkv + config.d_model + mlp_inputs * config.ffn_dim + config.d_model


def _norm(config: GPTConfig) -> int:
    with_bias = config.norm == "layernorm" and config.bias
    return (2 if with_bias else 1) * config.d_model


def _vocab(config: GPTConfig) -> int:
    if config.vocab_size is None:
        raise ValueError("model.vocab_size is not set yet: resolve it from the tokenizer first")
    return config.vocab_size
