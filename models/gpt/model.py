"""The GPT-2 architecture on tensor-parallel layers.

Pre-LayerNorm blocks, GELU MLP, learned positions, tied input/output embeddings, dropout,
causal scaled-dot-product attention. With tp ranks (Megatron-LM, Shoeybi et al. 2019):
- attention heads are split across ranks: QKV is column-parallel with its output features
  ordered (head, q|k|v, head_dim), so each rank's slice holds whole heads; the output
  projection is row-parallel;
- the MLP is column-parallel, then row-parallel;
- the token embedding is vocabulary-parallel and doubles as the output layer (tied), and
  the loss is computed on the vocabulary slices (no full logits anywhere).
Activations inside the model are (sequence, batch, features); under sequence parallelism
the residual stream holds this rank's sequence chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybrid.dropout import dropout
from hybrid.recompute import RecomputePolicy, maybe_recompute
from hybrid.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    gather_from_region,
    init_from_seed,
    parameter_shards,
    vocab_parallel_cross_entropy,
)
from hybrid.tensor_parallel.layers import parallel_linear_input
from hybrid.tensor_parallel.shards import seeded_slice

from .config import GPTConfig

INIT_STD = 0.02  # GPT-2's initializer_range


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, tp: TensorParallel, recompute_core: bool) -> None:
        super().__init__()
        self.tp, self.recompute_core = tp, recompute_core
        self.local_heads = config.n_head // tp.size
        self.dropout = config.dropout
        self.qkv = ColumnParallelLinear(config.d_model, 3 * config.d_model, tp)
        self.proj = RowParallelLinear(config.d_model, config.d_model, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = rearrange(
            self.qkv(x), "s b (h three d) -> three b h s d", h=self.local_heads, three=3
        )
        y = maybe_recompute(self.recompute_core, self._core, *qkv, rng=self.tp.rng)
        return self.proj(rearrange(y, "b h s d -> s b (h d)"))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V with the causal mask and attention dropout.

        Without dropout: the fused kernel (flash attention where available), which keeps no
        s x s tensor. With dropout: the explicit form, which keeps exactly the paper's
        5as^2b bytes (softmax output, 1-byte mask, dropout output; Korthikanti et al. 4.1);
        SDPA's CPU fallback would keep three fp32 s x s tensors instead. The heads differ
        across TP ranks, so the dropout draws from the TP stream.
        """
        if not (self.training and self.dropout > 0):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seq = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu_(1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        with self.tp.split_region_rng():
            probs = dropout(probs, self.dropout, self.training)
        return torch.matmul(probs, v)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(config.d_model, 4 * config.d_model, tp)
        self.proj = RowParallelLinear(4 * config.d_model, config.d_model, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(
        self, config: GPTConfig, tp: TensorParallel, recompute: RecomputePolicy, index: int
    ) -> None:
        super().__init__()
        self.tp = tp
        self.recompute_layer = recompute.full_layer(index)
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, tp, recompute.attention_core)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config, tp)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_recompute(self.recompute_layer, self._layer, x, rng=self.tp.rng)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._residual_dropout(self.attn(self.ln_1(x)))
        return x + self._residual_dropout(self.mlp(self.ln_2(x)))

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        with self.tp.residual_rng():
            return dropout(x, self.dropout, self.training)


class GPT(nn.Module):
    """GPT-2 at any tensor-parallel degree.

    `n_real_tokens` (default: `config.vocab_size`) is how many vocabulary entries are real
    tokens; the loss masks the rest (Megatron-style padding to a multiple of 128, and to a
    multiple of tp), so the loss equals that of the unpadded model.
    """

    def __init__(
        self,
        config: GPTConfig,
        tp: TensorParallel | None = None,
        recompute: RecomputePolicy | None = None,
        seed: int = 0,
        n_real_tokens: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """On `device="meta"` only shapes exist: nothing is allocated or initialised, and
        the Engine materialises each rank's shard from `initial_value` (ZeRO-3 at scale)."""
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set before building the model")
        tp = tp or TensorParallel.single(seed)
        recompute = recompute or RecomputePolicy()
        check_tp_shapes(config, tp.size, tp.sequence_parallel)
        self.config, self.tp = config, tp
        self.n_real_tokens = n_real_tokens or config.vocab_size
        self.seed = seed
        with torch.device(device or "cpu"):
            self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model, tp)
            self.wpe = nn.Embedding(config.seq_len, config.d_model)
            self.blocks = nn.ModuleList(
                Block(config, tp, recompute, i) for i in range(config.n_layer)
            )
            self.ln_f = nn.LayerNorm(config.d_model)
        if torch.device(device or "cpu").type != "meta":
            self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """GPT-2 initialisation (Radford et al. 2019, section 2.3), drawn per parameter from
        (seed, name) so every tp slices the same full weights (hybrid.tensor_parallel.shards).

        Weights N(0, 0.02), biases 0, LayerNorm (1, 0); the residual projections that write
        into the residual stream (attention and MLP output) are scaled by 1/sqrt(2 n_layer),
        since each layer adds two of them to the stream.
        """
        self.seed = seed
        init_from_seed(self, seed, self._init_rule, self.tp.rank)

    def initial_value(self, name: str) -> torch.Tensor:
        """This TP rank's slice of parameter `name` as `reset_parameters` draws it; one
        full parameter at a time, for materialising a model built on the meta device."""
        param = self.get_parameter(name)
        spec = parameter_shards(self).get(name)
        return seeded_slice(name, param, spec, self.seed, self._init_rule, self.tp.rank)

    def _init_rule(self, name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        if name.endswith("bias") or (".ln_" in name or name.startswith("ln_")):
            fill = 1.0 if name.endswith("weight") else 0.0
            return torch.full(shape, fill)
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        std = residual_std if name.endswith("proj.weight") else INIT_STD
        return torch.randn(shape, generator=gen) * std

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over tokens when `targets` (b, s) is given, else the full
        logits (b, s, vocab_size), gathered across TP."""
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds model.seq_len={self.config.seq_len}"
            )
        x = self._embed(idx.t())
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # The tied output layer: the embedding's vocabulary slice as a column-split weight.
        logits = parallel_linear_input(x, self.wte.weight, None, self.tp)  # (s, b, V/tp)
        if targets is None:
            full = gather_from_region(logits, self.tp.group)[..., : self.config.vocab_size]
            return full.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(
            logits, targets.t(), self.tp.group, self.wte.vocab_start, self.n_real_tokens
        )
        return loss.mean()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings with dropout; under sequence parallelism this rank's
        chunk of the sequence (the token embedding's reduction is a reduce-scatter)."""
        x = self.wte(ids)  # (s, b, h) or (s/tp, b, h)
        chunk = x.shape[0]
        start = self.tp.rank * chunk if self.tp.sequence_parallel else 0
        positions = torch.arange(start, start + chunk, device=ids.device)
        x = x + self.wpe(positions).unsqueeze(1)
        with self.tp.residual_rng():
            return dropout(x, self.config.dropout, self.training)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `new_tokens` tokens after the prompt `idx` (b, s); vocabulary padding is
        never sampled. Under TP every rank of the group must call it (same generator seed)."""
        for _ in range(new_tokens):
            context = idx[:, -self.config.seq_len :]
            if self.tp.sequence_parallel:  # the sequence must split evenly across TP ranks
                keep = context.shape[1] - context.shape[1] % self.tp.size
                context = context[:, -keep:] if keep else context[:, :1].expand(-1, self.tp.size)
            logits = self(context)[:, -1, : self.n_real_tokens].float()
            logits = logits / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def check_tp_shapes(config: GPTConfig, tp: int, sequence_parallel: bool) -> None:
    """Shapes a tensor-parallel GPT needs; each message names the numbers."""
    if config.d_model % config.n_head:
        raise ValueError(f"d_model={config.d_model} is not divisible by n_head={config.n_head}")
    if config.n_head % tp:
        raise ValueError(
            f"n_head={config.n_head} is not divisible by tp={tp}: attention heads are split "
            "across tensor-parallel ranks"
        )
    if sequence_parallel and config.seq_len % tp:
        raise ValueError(
            f"seq_len={config.seq_len} is not divisible by tp={tp}: sequence parallelism "
            "splits every sequence into tp equal chunks"
        )
