"""The GPT-2 architecture: pre-LayerNorm blocks, GELU MLP, learned positions, tied embeddings.

Layout notes that later parallel code relies on:
- QKV is one Linear whose output features are ordered (head, q|k|v, head_dim), so a split
  of the output dimension into contiguous pieces is a split by heads (Megatron-LM's layout).
- The output layer is the token embedding itself (weight tying, GPT-2 / Press & Wolf 2017).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybrid.recompute import Recompute, maybe_recompute

from .config import GPTConfig

INIT_STD = 0.02  # GPT-2's initializer_range


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, recompute: Recompute) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.recompute_core = recompute is Recompute.SELECTIVE
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b s (h three d) -> three b h s d", h=self.n_head, three=3)
        y = maybe_recompute(self.recompute_core, self._core, q, k, v)
        return self.resid_dropout(self.proj(rearrange(y, "b h s d -> b s (h d)")))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V with the causal mask and attention dropout."""
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, recompute: Recompute) -> None:
        super().__init__()
        self.recompute_layer = recompute is Recompute.FULL
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, recompute)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_recompute(self.recompute_layer, self._layer, x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, recompute: Recompute = Recompute.NONE) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set before building the model")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, recompute) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (Radford et al. 2019, section 2.3).

        Weights N(0, 0.02), biases 0, LayerNorm (1, 0); the residual projections that
        write into the residual stream (attention and MLP output) are scaled by
        1/sqrt(2 n_layer), since each layer adds two of them to the stream.
        """
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, s, V) when `targets` is None, else the mean cross-entropy over tokens."""
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds model.seq_len={self.config.seq_len}"
            )
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 40,
        n_real_tokens: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `new_tokens` tokens after the prompt `idx` (b, s).

        `n_real_tokens` masks the vocabulary padding so it is never sampled.
        """
        for _ in range(new_tokens):
            logits = self(idx[:, -self.config.seq_len :])[:, -1, :n_real_tokens].float()
            logits = logits / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
