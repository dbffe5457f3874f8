"""bf16 training keeps and steps fp32 master weights, across processes.

One 4-rank job: dp 2 at ZeRO stage 1 and at stage 2 (one rank pair each), then tp 2 x
dp 2 at stage 3, 4 bf16 AdamW steps each, against a single-process reference written
here from torch alone (bf16 forward and backward on a copy of fp32 masters, fp32
gradient average, torch.optim.AdamW on the masters). The learning rate is so small that
bf16-only weights could not follow (bf16_masters_cases): only fp32 masters move as the
reference's do.
"""

from __future__ import annotations

from typing import Any

import bf16_masters_cases as cases
import pytest
import torch

from hybrid.instruments.local_processes import run_processes

# How far the engine's master updates may stray from the reference's, as the norm of the
# difference of the updates (masters after a step minus the initial masters) over the
# norm of the reference's update. The engine differs from the reference in bf16 rounding
# only: its gradients are summed over micro-batches and DP in bf16 (the reference sums
# in fp32), and at tp 2 its bf16 matrix products are split differently. Adam's first
# steps move each weight by about +-LR whatever the gradient's size, so an element whose
# gradient is near zero may flip sign; measured: 0.023-0.042 at tp 1, 0.048-0.087 at tp 2
# (first step largest). A run without fp32 masters (bf16_masters_cases.reference with
# masters=False) misses by 0.90: its updates round away on most weights. 0.25 keeps
# about 3x of room on either side.
UPDATE_TOLERANCE = 0.25


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[name].reshape(-1) for name in sorted(weights)])


def update_error(
    got: dict[str, torch.Tensor],
    got_initial: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    want_initial: dict[str, torch.Tensor],
) -> float:
    """|update - reference update| / |reference update| over every weight."""
    assert got.keys() == want.keys()
    ours, theirs = flat(got) - flat(got_initial), flat(want) - flat(want_initial)
    assert theirs.norm() > 0
    return float((ours - theirs).norm() / theirs.norm())


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return cases.reference(masters=True)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_processes(cases.all_layouts, 4)


def test_the_tolerance_rejects_bf16_weights_without_masters(reference: dict[str, Any]) -> None:
    """The premise: the same training with bf16-only weights misses the reference's
    updates by far more than UPDATE_TOLERANCE at every step."""
    bf16_only = cases.reference(masters=False)
    for step in range(cases.STEPS):
        error = update_error(
            bf16_only["weights"][step],
            bf16_only["initial"],
            reference["weights"][step],
            reference["initial"],
        )
        assert error > 2 * UPDATE_TOLERANCE, (step, error)


def test_fp32_masters_follow_the_reference_at_every_layout(
    reference: dict[str, Any], ranks: list[dict[str, Any]]
) -> None:
    reported = [
        (rank["rank"], run["layout"]) for rank in ranks for run in rank["runs"] if run["masters"]
    ]
    assert reported == [
        (0, vars(cases.PAIR_LAYOUTS[0])),
        (0, vars(cases.WHOLE_LAYOUT)),
        (2, vars(cases.PAIR_LAYOUTS[1])),
    ]
    for rank in ranks:
        for run in rank["runs"]:
            where = f"rank {rank['rank']} {run['layout']}"
            # The parameters are bf16 and exactly the masters cast to bf16, as this rank's
            # shard and as the full gathered model, after every step.
            for step, recast in enumerate(run["recast"]):
                assert recast == {"shards": True, "full": True, "dtypes": ["torch.bfloat16"]}, (
                    where,
                    step,
                )
            # The loss is computed in bf16 at another layout: a sanity check only (the
            # tiny learning rate hardly moves it; the masters are what the test is about).
            assert run["losses"] == pytest.approx(reference["losses"], rel=1e-3), where
            if not run["masters"]:
                continue
            for name, want in reference["initial"].items():
                assert torch.equal(run["initial"][name], want), (where, name)
            for step in range(cases.STEPS):
                error = update_error(
                    run["masters"][step],
                    run["initial"],
                    reference["weights"][step],
                    reference["initial"],
                )
                assert error < UPDATE_TOLERANCE, (where, step, error)
