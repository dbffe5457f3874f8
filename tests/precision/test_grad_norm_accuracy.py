"""The clip norm is accurate over a bucket-sized gradient (hybrid.zero.gradients).

torch's CPU fp32 norm sums a tensor in one long accumulation: over a 25 MiB bucket's
segment its square is off by about 1e-4 relative, and the clip coefficient with it, which
made the losses of ours at stage 0 dp=2 part from a one-process run's by 1.2e-5 in three
steps (benchmarks/results.md's losses check). The engine sums the squares of 64K-element
rows' norms in float64 instead.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.zero.gradients import sum_of_squares

SEGMENT = 6_500_000  # fp32 elements of one 25 MiB bucket segment


def test_sum_of_squares_over_a_bucket_segment_is_float64_accurate() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one accumulation, as in a one-thread rank
    try:
        grad = torch.randn(SEGMENT, generator=torch.Generator().manual_seed(0))
        exact = float(grad.double().square().sum())
        whole = float(torch._foreach_norm([grad])[0].double().square())
        ours = float(sum_of_squares([grad[:1000], grad[1000:]]))
    finally:
        torch.set_num_threads(threads)
    # The premise: one fp32 norm of the whole segment misses by far more than the bound.
    assert abs(whole - exact) / exact > 1e-5
    assert ours == pytest.approx(exact, rel=1e-6)
