"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.gpt.config import GPTConfig


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


# Rows are normalised in this many pieces, so the fp32 temporaries (input, output and
# their gradients: 16 bytes an element) live for one piece at a time. Measured by MemTracker
# (tests/model/test_norms.py), forward and backward peak above torch's own bf16 LayerNorm, in
# bytes an element: 14 in one piece, 8 in 2, 5 in 4, 3.5 in 8. Each piece costs about 15
# ops (forward and backward): at 8 pieces about 40% of a bf16 layer's ops on CPU. 4 pieces
# take a quarter of the ops out of a fake-compute rehearsal of gpt3-175b's rank (10.5k
# instead of 14.1k for 2 layers, counted at the dispatcher) for 1.5 bytes an element of a
# transient.
PIECES = 4


class _LayerNormInFP32(torch.autograd.Function):
    """F.layer_norm computed in fp32 from a 16-bit input, forward and backward.

    Only the 16-bit input (and the parameters) are saved, as torch's own LayerNorm saves it,
    so a bf16 model's activation memory does not grow; backward casts it to fp32 again and
    runs fp32 LayerNorm's kernels (forward for the statistics, then backward), a piece of the
    rows at a time (PIECES), summing the weight and bias gradients over the pieces in fp32.
    The statistics are not saved: two (s, b) fp32 vectors would buy back only one cheap row
    reduction.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        params = [None if t is None else t.float() for t in (weight, bias)]
        for piece, into in zip(rows.tensor_split(PIECES), out.tensor_split(PIECES), strict=True):
            into.copy_(F.layer_norm(piece.float(), x.shape[-1:], *params, eps))
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        width = x.shape[-1]
        rows, grad_rows = x.reshape(-1, width), grad_out.reshape(-1, width)
        grad_x = torch.empty_like(rows)
        params = [None if t is None else t.detach().float() for t in (weight, bias)]
        sums = [None if t is None else torch.zeros_like(t) for t in params]  # fp32
        mask = [True, *(t is not None for t in params)]  # the gradients wanted: x, w, b
        pieces = zip(
            rows.tensor_split(PIECES),
            grad_rows.tensor_split(PIECES),
            grad_x.tensor_split(PIECES),
            strict=True,
        )
        # The kernels autograd would run for an fp32 F.layer_norm (its forward for the
        # statistics, then its backward), called directly: no graph to build per piece.
        for piece, grad_piece, into in pieces:
            piece = piece.float()
            mean, rstd = torch.ops.aten.native_layer_norm(piece, (width,), *params, ctx.eps)[1:]
            grads = torch.ops.aten.native_layer_norm_backward(
                grad_piece.float(), piece, (width,), mean, rstd, *params, mask
            )
            into.copy_(grads[0])
            for total, grad in zip(sums, grads[1:], strict=True):
                if total is not None:
                    total += grad
            del piece, mean, rstd, grads  # before the next piece's are made
        grad_params = [
            None if total is None else total.to(t.dtype)
            for t, total in zip((weight, bias), sums, strict=True)
        ]
        return grad_x.view(x.shape), *grad_params, None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, same state-dict names) that computes in fp32 when
    its input is 16-bit, as autocast runs layer_norm and as Megatron's fused LayerNorm
    accumulates.

    Why: torch's CPU bf16 LayerNorm backward sums the weight and bias gradients over rows
    with a relative error of 0.05-0.11 (fp32 inside: below 0.007;
    benchmarks/precision/bf16_gradient_error.py), ten to thirty times that of the whole bf16
    gradient. CUDA's layer_norm kernels already accumulate 16-bit inputs in fp32
    (acc_type; tests/model/test_norms.py checks it where a GPU is present), so there torch's
    kernel runs unchanged, as it does for fp32 inputs.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.is_cuda:
            return super().forward(x)
        return _LayerNormInFP32.apply(x, self.weight, self.bias, self.eps)


def make_norm(config: GPTConfig) -> nn.Module:
    """The model's norm over d_model. Under sequence parallelism it runs on this rank's
    sequence chunk and its parameters are replicated (their gradients are summed over TP)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
