"""How long a real-compute rehearsal will take here, said before it starts.

A CPU's bf16 matrix products run at 1-16x fp32's with AVX-512 BF16 or AMX and at about
1/60 of it without (0.8 against 50 GFLOP/s on an AVX2-only EPYC): rehearsing 8 of
turing-nlg-17b's 78 layers in bf16 took 2,055 s for one step there. A small timed GEMM of
the run's dtype (launch.observe.matmul_rate) and the planner's FLOPs for the step give
the order of magnitude in a second, before the hours.
"""

from __future__ import annotations

import torch

from hybrid.engine_config import DTYPES
from launch.observe import matmul_rate
from launch.planning.rehearsal_request import Request, planned_step_flops


def real_compute_estimate(request: Request, device: torch.device) -> str:
    """One line: this device's matmul rate in the run's dtype and the rehearsal's duration
    at that rate (every step's planned FLOPs; the instrumented first step runs slower)."""
    precision = request.config.train.precision
    gflops = matmul_rate.matmul_gflops(DTYPES[precision], device.type)
    seconds = request.steps * planned_step_flops(request) / (gflops * 1e9)
    minutes = seconds / 60
    took = f"about {minutes:.0f} min" if minutes >= 1 else f"about {seconds:.0f} s"
    line = f"{precision} matmul here: {gflops:.1f} GFLOP/s; {took} for {request.steps} step"
    line += "s" if request.steps != 1 else ""
    if minutes >= 10:
        line += "; use --compute fake or train.precision=fp32 for memory only"
    return line
