"""Causal self-attention on tensor-parallel layers: multi-head or grouped-query, with
learned (added to the embeddings elsewhere) or rotary positions."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybrid.dropout import dropout
from hybrid.recompute import maybe_recompute
from hybrid.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from models.gpt.config import GPTConfig


class CausalSelfAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V over the causal past, heads split across TP ranks.

    QKV is one column-parallel projection whose output features are ordered
    (kv_head, [q_1 .. q_g, k, v], head_dim), with g = n_head / n_kv_head query heads
    sharing each key/value head (grouped-query attention, Ainslie et al. 2023,
    arXiv 2305.13245; query head i uses kv head i // g, as in Hugging Face's repeat_kv).
    A contiguous slice of whole kv groups holds its query heads and their shared key and
    value, so TP splits QKV by groups (Megatron-LM, Shoeybi et al. 2019) and the layout
    does not depend on tp. With g = 1 it is (head, q|k|v, head_dim). The output
    projection is row-parallel.
    """

    def __init__(self, config: GPTConfig, tp: TensorParallel, recompute_core: bool) -> None:
        super().__init__()
        self.tp, self.recompute_core = tp, recompute_core
        self.local_kv = config.kv_heads // tp.size
        self.group = config.n_head // config.kv_heads
        self.dropout = config.dropout
        self.rope_theta = config.rope_theta if config.positions == "rope" else None
        qkv_features = (config.n_head + 2 * config.kv_heads) * config.head_dim
        attn_features = config.n_head * config.head_dim
        self.qkv = ColumnParallelLinear(config.d_model, qkv_features, tp, bias=config.bias)
        self.proj = RowParallelLinear(attn_features, config.d_model, tp, bias=config.bias)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (s, b, features). Packed sequences (several documents in a row) come with
        `mask` (b, 1, s, s), True where a query may attend to a key (document_mask), and
        `positions` (b, s), each document's own positions from 0 (segment_positions)."""
        g = self.group
        parts = rearrange(self.qkv(x), "s b (kv p d) -> p b kv s d", kv=self.local_kv, p=g + 2)
        # One split, not three indexings: its backward is one concatenation, where each
        # index's backward would zero a QKV-sized gradient and the three would be summed.
        queries, k, v = parts.split([g, 1, 1])
        q = rearrange(queries, "g b kv s d -> b (kv g) s d")
        k, v = k.squeeze(0), v.squeeze(0)
        if self.rope_theta is not None:
            # The QKV projection gathered the sequence (under sequence parallelism too), so
            # q and k hold the whole sequence: positions 0 .. s-1.
            if positions is None:  # every layer, every step: one table per shape
                cos, sin = rotary_table(q.shape[-2], q.shape[-1], self.rope_theta, q)
            else:  # packed rows: each row's own positions
                cos, sin = rotary_cos_sin(
                    q.shape[-2], q.shape[-1], self.rope_theta, q.device, positions
                )
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = maybe_recompute(self.recompute_core, self._core, q, k, v, mask, rng=self.tp.rng)
        return self.proj(rearrange(y, "b h s d -> s b (h d)"))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q (b, heads, s, d), k and v (b, kv_heads, s, d) -> (b, heads, s, d); `mask`
        (b, 1, s, s) or None (plain causal).

        The fused kernel (SDPA: flash or memory-efficient attention where available),
        which keeps no s x s tensor: without dropout everywhere, and with dropout on CUDA,
        whose kernels draw the dropout themselves (`dropout_p`). With dropout on CPU: the
        explicit form, which keeps exactly the paper's 5as^2b bytes (softmax output, 1-byte
        mask, dropout output; Korthikanti et al. 4.1), where SDPA's CPU fallback would keep
        three fp32 s x s tensors. The heads differ across TP ranks, so dropout draws from
        the TP stream (fork() swaps the default generator's state, which SDPA draws from).
        """
        p = self.dropout if self.training else 0.0
        if p == 0.0 or q.device.type == "cuda":
            options = {"enable_gqa": True} if self.group > 1 else {}
            if mask is not None:  # the explicit mask is causal already
                options["attn_mask"] = mask
            else:
                options["is_causal"] = True
            if p == 0.0:
                return F.scaled_dot_product_attention(q, k, v, **options)
            with self.tp.split_region_rng():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **options)
        seq = q.shape[-2]
        q = q.unflatten(1, (-1, self.group))  # (b, kv, g, s, d): broadcast k, v over g
        k, v = k.unsqueeze(2), v.unsqueeze(2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if mask is None:
            hidden = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu_(1)
        else:
            hidden = ~mask.unsqueeze(2)  # (b, 1, 1, s, s) against scores (b, kv, g, s, s)
        probs = F.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        with self.tp.split_region_rng():
            probs = dropout(probs, self.dropout, self.training)
        return torch.matmul(probs, v).flatten(1, 2)


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, s) boolean attention mask of packed sequences: query i attends to key j
    when j <= i and both belong to the same document (segment id), so each document of a
    row sees only itself, block-diagonal and causal.

    Cost: b*s*s bytes and SDPA's masked kernel (no flash path on CPU), where plain causal
    attention keeps no s x s tensor. The scalable path is a varlen / document-aware kernel
    (flash-attention's cu_seqlens, or FlexAttention's block mask), which skips the
    masked-out blocks instead of computing them.
    """
    seq = segments.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril_()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal).unsqueeze(1)


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """(b, s) positions that restart at 0 where the segment id changes, so a packed
    document gets the positions it would have alone (learned and rotary alike)."""
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def rotary_cos_sin(
    seq: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (seq, head_dim), in fp32; with `positions`
    (b, s), per row: (b, 1, s, head_dim), broadcast over the heads.

    Rotary position embedding (RoFormer, Su et al. 2021, arXiv 2104.09864): frequencies
    theta^(-2i/d), i < d/2. The paper rotates the pairs of features (2i, 2i+1); GPT-NeoX
    and Hugging Face's Llama rotate (i, i + d/2) ("rotate_half"), which is the paper's
    rotation after a fixed permutation of each head's q and k features. We use the
    rotate-half layout, so Hugging Face Llama checkpoints load without permuting weights;
    the angles are computed as Hugging Face does (fp32, position * inverse frequency).
    """
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    inverse_frequency = 1.0 / (theta ** (steps / head_dim))
    if positions is None:
        angles = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inverse_frequency
    else:
        angles = (positions.to(torch.float32)[..., None] * inverse_frequency).unsqueeze(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotary_table(
    seq: int, head_dim: int, theta: float, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_cos_sin for positions 0 .. seq-1, in `like`'s dtype and on its device:
    computed once per (seq, head_dim, theta, device, dtype) and reused, where every layer
    of every step would otherwise recompute it. Not cached in inference mode (its tensors
    could not be saved for a later backward) nor on the meta device."""
    if torch.is_inference_mode_enabled() or like.device.type == "meta":
        cos, sin = rotary_cos_sin(seq, head_dim, theta, like.device)
        return cos.to(like.dtype), sin.to(like.dtype)
    return _cached_rotary_table(seq, head_dim, theta, like.device, like.dtype)


@functools.lru_cache(maxsize=16)  # a few sequence lengths x devices x dtypes in a job
def _cached_rotary_table(
    seq: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        cos, sin = rotary_cos_sin(seq, head_dim, theta, device)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's features of x (..., s, d) in the rotate-half layout: feature i
    pairs with i + d/2, so every head is rotated whole, on any TP rank."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
