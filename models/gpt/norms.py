"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama)."""

from __future__ import annotations

import torch
from torch import nn

from .config import GPTConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g: LayerNorm without centring and without bias
    (Zhang & Sennrich 2019, arXiv 1910.07467).

    The statistic is computed in fp32 and the normalised activations are cast back before
    the gain, as Llama does (and Hugging Face's LlamaRMSNorm), so bf16 runs match it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config: GPTConfig) -> nn.Module:
    """The model's norm over d_model. Under sequence parallelism it runs on this rank's
    sequence chunk and its parameters are replicated (their gradients are summed over TP)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
