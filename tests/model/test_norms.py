"""models.gpt's LayerNorm in bf16: computed in fp32, so its gradients carry one bf16 rounding
and no more; in fp32 it is torch's LayerNorm; it saves no more for backward than torch's.

The reference is an fp64 LayerNorm of the same bf16-valued input, parameters and output
gradient, an independent computation (torch's fp64 kernel, not our function)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from models.gpt.norms import LayerNorm

D = 128


def _inputs(rows: int, bias: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, D, generator=g) * 3 + 1
    grad = torch.randn(rows, D, generator=g)
    weight = torch.randn(D, generator=g) * 0.1 + 1
    b = torch.randn(D, generator=g) * 0.1 if bias else None
    return x, grad, weight, b


def _gradients(
    norm: nn.LayerNorm, dtype: torch.dtype, rows: int, bias: bool, device: str = "cpu"
) -> list[torch.Tensor]:
    """Output and gradients of x, weight (and bias), as fp64 on the CPU, for inputs
    rounded to bf16."""
    x, grad, weight, b = (
        None if t is None else t.bfloat16().to(device, dtype) for t in _inputs(rows, bias)
    )
    norm = norm.to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        if bias:
            norm.bias.copy_(b)
    x = x.clone().requires_grad_()
    y = norm(x)
    y.backward(grad)
    params = [norm.weight, norm.bias] if bias else [norm.weight]
    return [t.detach().cpu().double() for t in (y, x.grad, *(p.grad for p in params))]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_gradients_are_one_rounding_from_fp64(bias: bool, device: str) -> None:
    # 4096 rows: the weight and bias gradients are sums over rows, where a 16-bit
    # accumulation shows (torch's CPU bf16 LayerNorm: 5.6e-2 and 6.0e-2 here). On CUDA
    # our LayerNorm runs torch's kernel, which this checks accumulates in fp32.
    rows = 4096
    reference = _gradients(nn.LayerNorm(D, bias=bias), torch.float64, rows, bias)
    ours = _gradients(LayerNorm(D, bias=bias), torch.bfloat16, rows, bias, device)
    names = ("y", "dx", "dweight", "dbias")[: len(ours)]
    for name, got, want in zip(names, ours, reference, strict=True):
        error = float((got - want).norm() / want.norm())
        # One bf16 rounding of each element: relative error at most 2^-9 per element,
        # about 1.5e-3 in norm for these values.
        assert error < 3e-3, (name, error)


def test_fp32_is_torchs_layer_norm_bitwise() -> None:
    x, grad, weight, b = _inputs(64, True)
    ours = _gradients(LayerNorm(D), torch.float32, 64, True)
    x = x.bfloat16().float().requires_grad_()
    w, bb = (t.bfloat16().float().requires_grad_() for t in (weight, b))
    y = F.layer_norm(x, (D,), w, bb, 1e-5)
    y.backward(grad.bfloat16().float())
    for got, want in zip(ours, (y, x.grad, w.grad, bb.grad), strict=True):
        assert torch.equal(got, want.double())


def _saved_bytes(norm: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward, counted by torch's saved-tensor hook."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return total


def test_bf16_saves_no_more_than_torchs_layer_norm() -> None:
    x = torch.randn(64, 8, D, dtype=torch.bfloat16, requires_grad=True)
    ours = _saved_bytes(LayerNorm(D).bfloat16(), x)
    torchs = _saved_bytes(nn.LayerNorm(D).bfloat16(), x)
    # The bf16 input and the parameters; torch's also keeps fp32 mean and rstd per row.
    assert ours == x.numel() * 2 + 2 * D * 2
    assert ours <= torchs


def _peak_bytes(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    """The peak of everything torch allocated over forward and backward, by MemTracker."""
    tracker = MemTracker()
    with tracker:
        norm(x).backward(grad)
    x.grad = None
    return sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())


def test_bf16_peak_is_near_torchs_layer_norm() -> None:
    x = torch.randn(4096, D, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    ours = _peak_bytes(LayerNorm(D).bfloat16(), x, grad)
    torchs = _peak_bytes(nn.LayerNorm(D).bfloat16(), x, grad)
    # The pieces' fp32 temporaries: about 5 bytes an element above torch's (all rows at
    # once: 14; models/gpt/norms.py's PIECES).
    assert ours - torchs <= 6 * x.numel(), (ours, torchs)


def test_state_dict_names_are_torchs() -> None:
    assert LayerNorm(D).state_dict().keys() == nn.LayerNorm(D).state_dict().keys()
