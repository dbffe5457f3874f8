"""ZeRO stages 0-3: 20 AdamW steps equal plain single-process AdamW (fp32, dropout 0,
gradient accumulation 2, clipping active) within 1e-5 relative."""

from __future__ import annotations

import pytest
import zero_cases

from hybrid.instruments.local_processes import run_processes


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return zero_cases.reference_losses()


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_adamw(stage: int, dp: int, reference: list[float]) -> None:
    # dp=2 also reduces in buckets that hold several units (0.1 MB); others one bucket.
    bucket_mb = 0.1 if dp == 2 else 25.0
    losses = run_processes(zero_cases.engine_losses, dp, stage, 1, False, "none", bucket_mb)[0]
    assert len(losses) == 20 and reference[-1] < reference[0] - 0.2
    assert losses == pytest.approx(reference, rel=1e-5)


def test_stage3_tp2_dp2_sequence_parallel_full_recompute(reference: list[float]) -> None:
    losses = run_processes(zero_cases.engine_losses, 4, 3, 2, True, "full")[0]
    assert losses == pytest.approx(reference, rel=1e-5)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    for records in run_processes(zero_cases.fp16_overflow, 2):
        assert [r["skipped"] for r in records] == [False, False, True, False]
        assert [r["scale"] for r in records] == [1024.0, 1024.0, 512.0, 512.0]
        assert [r["changed"] for r in records] == [True, True, False, True]
