"""Gradient clipping acts, and its norm is right, at every ZeRO stage and TP layout.

One 4-rank job runs 3 clipped AdamW steps at tp 1 x dp 4 (stages 0-3) and tp 2 x dp 2
(stages 0-3, with and without sequence parallelism), each against one process (tp 1,
dp 1) that clips with `torch.nn.utils.clip_grad_norm_`. Every step's gradient norm is
above the clip; the engine's pre-clip norm equals torch's within 1e-5 relative on every
rank, and the weights after each clipped step equal the reference's, which an unclipped
step would miss by far more than the tolerance (checked on the reference itself).
"""

from __future__ import annotations

from typing import Any

import clipping_cases as cases
import pytest
import torch

from hybrid.instruments.local_processes import run_processes

# fp32 on CPU at another layout sums in another order: about 1e-7 relative per step, and
# Adam with a large eps (clipping_cases) passes gradient differences on almost unchanged.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def reference() -> dict[str, list[Any]]:
    return cases.reference(clip=True)


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, Any]]]:
    """Every rank's results, one per layout (rank 0's carry the weights)."""
    return run_processes(cases.all_layouts, 4)


def share_beyond(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], bound: float) -> float:
    """The share of weight elements where `a` and `b` differ by more than `bound`."""
    assert a.keys() == b.keys()
    differences = torch.cat([(a[name] - b[name]).abs().reshape(-1) for name in a])
    return float((differences > bound).double().mean())


def test_an_unclipped_step_would_miss_the_reference(reference: dict[str, list[Any]]) -> None:
    """The premise: at every step the clip moves almost every weight by far more than
    the tolerance, so matching the clipped reference's weights shows the engine clipped."""
    assert all(norm > 5 * cases.CLIP for norm in reference["norms"])
    unclipped = cases.reference(clip=False)
    for clipped, free in zip(reference["weights"], unclipped["weights"], strict=True):
        assert share_beyond(clipped, free, 10 * WEIGHT_ATOL) > 0.9


def test_norm_and_clipped_weights_match_torch_at_every_layout(
    reference: dict[str, list[Any]], ranks: list[list[dict[str, Any]]]
) -> None:
    """Step by step, so the first wrong step is the one named: its norm on every rank,
    then the weights after it (gathered to tp=1 on rank 0)."""
    assert [r["layout"] for r in ranks[0]] == [vars(layout) for layout in cases.LAYOUTS]
    for index, layout in enumerate(ranks[0]):
        for step in range(cases.STEPS):
            where = f"{layout['layout']} step {step}"
            want = reference["norms"][step]
            for rank, results in enumerate(ranks):
                got = results[index]
                assert not got["skipped"][step], where
                assert got["norms"][step] > cases.CLIP, f"rank {rank} {where}"
                assert got["norms"][step] == pytest.approx(want, rel=1e-5), f"rank {rank} {where}"
            weights, expected = layout["weights"][step], reference["weights"][step]
            assert weights.keys() == expected.keys()
            for name in expected:
                torch.testing.assert_close(
                    weights[name],
                    expected[name],
                    rtol=WEIGHT_RTOL,
                    atol=WEIGHT_ATOL,
                    msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
                )
