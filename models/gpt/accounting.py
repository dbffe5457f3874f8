"""Closed-form parameter and FLOP counts for the GPT in `model.py`, and the numbers the
planner (hybrid.memory) takes: parameters per tensor-parallel rank, the shape that sets
activation memory, the FLOPs recomputation adds."""

from __future__ import annotations

import dataclasses
import math

from hybrid.memory import RankParameters, TransformerShape
from models.gpt.config import GPTConfig


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


def rank_parameters(config: GPTConfig, tp: int) -> RankParameters:
    """Parameters one of `tp` ranks holds, exactly as `GPT(config, tp)` builds them: the
    vocabulary tables keep ceil(V/tp) rows each (padded locally, models/gpt/model.py);
    QKV, the MLP input and their biases are split by output features, the attention and
    MLP output matrices by input features; norms, the output biases (added once, after the
    reduction) and the position table are replicated. The shapes must divide by tp
    (`check_tp_shapes`)."""
    h = config.d_model
    local_vocab = -(-_vocab(config) // tp)
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    mlp_inputs = 2 if config.mlp == "swiglu" else 1
    split = h * qkv + config.n_head * config.head_dim * h + (mlp_inputs + 1) * h * config.ffn_dim
    split_biases = (qkv + mlp_inputs * config.ffn_dim) if config.bias else 0
    layer_replicated = 2 * _norm(config) + (2 * h if config.bias else 0)
    layer = (split + split_biases) // tp + layer_replicated
    root_replicated = _norm(config) + (config.seq_len * h if config.positions == "learned" else 0)
    tables = 1 if config.tie_embeddings else 2
    root = tables * local_vocab * h + root_replicated
    return RankParameters(
        root=root,
        units=(layer,) * config.n_layer,
        replicated=root_replicated + config.n_layer * layer_replicated,
        total=count_parameters(config),
    )


def transformer_shape(
    config: GPTConfig, seq_len: int | None = None, device_type: str = "cpu"
) -> TransformerShape:
    """The dimensions activation memory and TP traffic depend on; `seq_len` is the
    training window (train.seq_len) when shorter than the model's; `device_type` picks
    the attention path the model takes with dropout (models.gpt.attention: on CUDA the
    fused kernel draws it, on CPU the explicit core keeps s x s tensors)."""
    return TransformerShape(
        layers=config.n_layer,
        hidden=config.d_model,
        heads=config.n_head,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        ffn=config.ffn_dim,
        gated_mlp=config.mlp == "swiglu",
        vocab=_vocab(config),
        seq_len=seq_len or config.seq_len,
        dropout=config.dropout > 0,
        dropout_in_kernel=device_type == "cuda",
    )


def recompute_flops_per_token(config: GPTConfig, mode: str, every: int = 1) -> float:
    """FLOPs per token that recomputation adds to a training step. Full: the forward of
    every recomputed layer once more (Narayanan et al. 2021: 96 instead of 72 B s l h^2);
    with `every` = k only ceil(l/k) layers are. Selective (Korthikanti et al. 2022,
    section 5): the attention core's forward, 4 h s per layer (QK^T and the product with
    V), no GEMM of the weights."""
    if mode == "full":
        share = math.ceil(config.n_layer / every) / config.n_layer
        return share * (flops_per_token(config, True) - flops_per_token(config))
    if mode == "selective":
        return 4 * config.n_layer * config.d_model * config.seq_len
    return 0.0


def with_seq_len(config: GPTConfig, seq_len: int | None) -> GPTConfig:
    """The config whose FLOPs match a training window `seq_len` (the parameters keep the
    model's position table; only attention's s changes)."""
    return config if seq_len is None else dataclasses.replace(config, seq_len=seq_len)


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
