"""The feed-forward sublayer: GELU (GPT-2) or SwiGLU (Llama), column- then row-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from models.gpt.config import GPTConfig


class MLP(nn.Module):
    """proj(gelu(fc(x))) with GPT-2's tanh approximation of GELU (Hugging Face's
    "gelu_new"); fc is column-parallel, proj row-parallel (Megatron-LM section 3)."""

    def __init__(self, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.ffn_dim
        self.fc = ColumnParallelLinear(config.d_model, hidden, tp, bias=config.bias)
        self.proj = RowParallelLinear(hidden, config.d_model, tp, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The GELU runs inside proj, whose backward writes gelu's gradient over its own
        # input gradient: one b*s*4d/tp buffer fewer at the backward's peak.
        return self.proj(self.fc(x), activation="gelu_tanh")


class SwiGLU(nn.Module):
    """proj(silu(x W_gate) * (x W_up)) (Shazeer 2020, arXiv 2002.05202; Llama's MLP).

    Gate and up are one column-parallel projection `fc` whose output features are
    interleaved, (feature, gate|up): any contiguous slice of whole pairs holds matching
    gate and up features, so each TP rank's slice (d_ff / tp pairs) is self-contained and
    the layout does not depend on tp, as with attention's (head, q|k|v, head_dim). One
    GEMM also keeps Megatron's one f (or one sequence all-gather) per MLP.
    """

    def __init__(self, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.ffn_dim
        self.fc = ColumnParallelLinear(config.d_model, 2 * hidden, tp, bias=config.bias)
        self.proj = RowParallelLinear(hidden, config.d_model, tp, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.proj(F.silu(gate) * up)


def make_mlp(config: GPTConfig, tp: TensorParallel) -> nn.Module:
    return SwiGLU(config, tp) if config.mlp == "swiglu" else MLP(config, tp)
