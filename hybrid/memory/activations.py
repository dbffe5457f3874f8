"""Activation bytes per GPU: Korthikanti et al. 2022 (arXiv 2205.05198), term by term.

Section 4.1 counts what one transformer layer keeps for backward, with s the sequence, b
the micro-batch, h the hidden size, a the heads, 16-bit activations and 1-byte dropout
masks: 34 sbh + 5 a s^2 b (Table 2, no parallelism). `paper_layer_bytes` is that table.
`layer_bytes` is the same count for our layer (models/gpt), written per tensor so that it
also holds for fp32, another MLP width, grouped-query heads, SwiGLU, and no dropout:

  replicated across TP (divided by t under sequence parallelism, section 4.2.2):
    2 norm inputs + 2 column-parallel inputs (the norm outputs): 4 e sbh
    2 dropout masks (residual branches), 1 byte each:            2 sbh
  split across TP (divided by t, section 4.2.1):
    QKV output (Q, K, V):               e sb (a + 2 a_kv) d
    attention output (projection input): e sb a d
    MLP: GELU input and output 2 e sb f; SwiGLU gate|up, silu(gate), product 4 e sb f
  attention core, split across TP:
    with dropout on CPU (the explicit form): softmax, its 1-byte mask, dropout output:
      (2e + 1) a s^2 b, plus our s x s boolean causal mask (once per layer)
    otherwise the fused kernel (SDPA's flash or memory-efficient attention; on CUDA it
      draws the dropout itself and regenerates it in backward), which keeps only the
      log-sum-exp per row, fp32: 4 a s b; the output is the projection input above.
With e = 2, d = h/a, f = 4h and dropout this is the paper's sbh(10 + 24/t + 5as/(ht)).
Selective recomputation (section 5) drops the core's terms; full recomputation keeps
only each layer's input, e sbh (/t with SP), and re-runs one layer at a time in backward,
whose working set (one layer without recomputation) comes on top.

Outside the layers (section 4.3): the embedding's dropout mask, sbh (/t with SP); the
final norm's and the output layer's inputs, 2 e sbh (/t with SP); the loss's fp32
softmax over this rank's vocabulary slice, 4 sb v/t. The loss also holds the logits
while it runs (e sb v/t): its one fp32 buffer (a copy of bf16 logits, the shifted copy of
fp32 ones) becomes the exponentials and then the softmax in place
(hybrid.tensor_parallel.cross_entropy).

Not counted (each under 1% at h >= 64): norm statistics (2 per token), token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class TransformerShape:
    """What activation memory and tensor-parallel traffic depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # MLP width (4h for GPT-2)
    gated_mlp: bool  # SwiGLU: gate and up projections
    vocab: int  # padded vocabulary (the model's table)
    seq_len: int  # tokens per training sequence
    dropout: bool  # dropout > 0: 1-byte masks kept on the residual branches
    # The attention kernel draws the dropout itself (SDPA on CUDA) and keeps no s x s
    # tensor; False: with dropout, the explicit core of models/gpt/attention.py (CPU).
    dropout_in_kernel: bool = False
    # The token embedding doubles as the output layer: autograd then holds the output
    # layer's weight gradient through backward until the embedding's part is added to it.
    tied_embeddings: bool = True


def paper_layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Korthikanti et al. 2022, Table 2: bytes per layer, 16-bit activations."""
    check_recompute(recompute)
    sbh, attention = s * b * h, 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        attention = 0.0
    if sequence_parallel:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


def layer_bytes(
    shape: TransformerShape,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    element: int,
) -> float:
    """Bytes one layer keeps for backward on one TP rank (see the module docstring)."""
    check_recompute(recompute)
    s, b, h, t, e = shape.seq_len, micro_batch, shape.hidden, tp, element
    chunk = t if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / chunk
    masks = 2 if shape.dropout else 0
    replicated = (4 * e + masks) * s * b * h / chunk
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    mlp = (4 if shape.gated_mlp else 2) * shape.ffn
    split = e * s * b * (qkv + shape.heads * shape.head_dim + mlp) / t
    core = 0.0
    if recompute == "none" and shape.dropout and not shape.dropout_in_kernel:
        core = (2 * e + 1) * shape.heads * s * s * b / t + s * s
    elif recompute == "none":
        core = 4 * shape.heads * s * b / t
    return replicated + split + core


def activation_bytes(
    shape: TransformerShape,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    element: int,
    recompute_every: int = 1,
) -> dict[str, float]:
    """Activation bytes on one GPU for one micro-batch, by part; `total` is their sum.
    With full recomputation every `recompute_every`-th layer (0, k, 2k, ...) keeps only
    its input and the others keep everything."""
    s, b, h, t = shape.seq_len, micro_batch, shape.hidden, tp
    chunk = t if sequence_parallel else 1
    args = (shape, micro_batch, tp, sequence_parallel)
    recomputed = math.ceil(shape.layers / recompute_every) if recompute == "full" else 0
    kept = layer_bytes(*args, "none" if recompute == "full" else recompute, element)
    local_vocab = -(-shape.vocab // t)
    parts = {
        "layers": recomputed * layer_bytes(*args, "full", element)
        + (shape.layers - recomputed) * kept,
        # One layer re-run in backward holds all its activations until its backward ends.
        "recompute_working_set": layer_bytes(*args, "none", element) if recomputed else 0.0,
        "embedding": (s * b * h / chunk) if shape.dropout else 0.0,
        "output": 2 * element * s * b * h / chunk,
        "loss": 4 * s * b * local_vocab,
        "loss_buffers": element * s * b * local_vocab,  # the logits, while the loss runs
    }
    parts["total"] = sum(parts.values())
    return parts


def stored_activation_bytes(parts: dict[str, float]) -> float:
    """The part autograd saves during forward (what a saved-tensor hook measures)."""
    return parts["layers"] + parts["embedding"] + parts["output"] + parts["loss"]


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} must be one of {'|'.join(RECOMPUTE_MODES)}")
