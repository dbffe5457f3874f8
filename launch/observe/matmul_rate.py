"""How fast this machine multiplies matrices in a dtype: a small timed GEMM.

CPUs differ: with AVX-512 BF16 or AMX, torch's bf16 matmul beats fp32; with AVX2 only it
runs about 60x slower (0.8 against 50 GFLOP/s seen on an AMD EPYC). Whatever depends on
bf16 speed (a benchmark's bf16 pairs, a bf16 run on CPU) asks here first instead of
guessing from the CPU's name.
"""

from __future__ import annotations

import time

import torch


def matmul_gflops(dtype: torch.dtype, device: str = "cpu", size: int = 256) -> float:
    """GFLOP/s of a (size x size) @ (size x size) product in `dtype`, best of a few tries.

    Best, not mean: on a shared machine other work only ever slows a try down, so the
    fastest one is the closest to what the kernels can do.
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    flops = 2.0 * size**3
    best = float("inf")
    budget = time.perf_counter() + 0.5  # a slow kernel gets few tries, not a long wait
    for attempt in range(5):
        if device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
        if attempt >= 1 and time.perf_counter() > budget:
            break
    return flops / best / 1e9


def native_bf16(device: str = "cpu") -> tuple[bool, str]:
    """Whether bf16 matrix products run at least as fast as fp32 here, and the rates.

    The verdict is a measurement: bf16 at half fp32's rate or better counts as native
    (real bf16 kernels run at 1-16x fp32; the emulated path runs at ~1/60).
    """
    bf16 = matmul_gflops(torch.bfloat16, device)
    fp32 = matmul_gflops(torch.float32, device)
    native = bf16 >= 0.5 * fp32
    detail = (
        f"bf16 matmul here: {bf16:.1f} GFLOP/s against {fp32:.1f} GFLOP/s in fp32 "
        f"({'native bf16 kernels' if native else 'no native bf16 matrix kernels'})"
    )
    return native, detail


def slow_bf16_warning(precision: str) -> str | None:
    """For a training run about to start: a warning when it would run bf16 matrix products
    on a CPU without native kernels (about 1/60 of fp32's speed), else None."""
    if precision != "bf16" or torch.cuda.is_available():
        return None
    native, detail = native_bf16("cpu")
    if native:
        return None
    return f"{detail}: this bf16 run will be slow here; train.precision=fp32 runs faster"
