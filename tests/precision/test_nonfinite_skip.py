"""A NaN loss or an inf gradient on one rank skips the step on every rank, leaving every
state tensor bit for bit as it was; training then goes on as if the batch had never come.

One 2-rank job (dp 2) at ZeRO stages 0-3 in fp32 and stages 1 and 3 in bf16 (whose fp32
masters are tensors of their own). At step 2 rank 1 either multiplies one micro-batch's
loss by NaN or puts +inf into one element of one gradient. On that step every rank's
parameters (full buffers or shards), fp32 masters, Adam moments and step counters keep
their bytes; every later loss, and the final state, equal bit for bit those of a run on
the same batches without step 2's (tests/precision/nonfinite_cases.py). The launcher's reaction
(a warning, or stopping) is tests/reliability/test_reliability.py's.
"""

from __future__ import annotations

import math
from typing import Any

import nonfinite_cases as cases
import pytest

from hybrid.instruments.local_processes import run_processes


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, Any]]]:
    return run_processes(cases.all_cases, 2)


def _name(result: dict[str, Any]) -> str:
    case = result["case"]
    return f"stage {case['stage']} {case['precision']} {result['fault']}"


def test_every_case_and_fault_ran_on_every_rank(ranks: list[list[dict[str, Any]]]) -> None:
    expected = [(vars(c), f) for c in cases.CASES for f in cases.FAULTS]
    for results in ranks:
        assert [(r["case"], r["fault"]) for r in results] == expected


def test_the_faulty_step_is_skipped_on_every_rank_with_no_state_touched(
    ranks: list[list[dict[str, Any]]],
) -> None:
    for rank, results in enumerate(ranks):
        for result in results:
            where, run = f"rank {rank} {_name(result)}", result["run"]
            assert run["skipped"] == [s == cases.BAD_STEP for s in range(cases.STEPS)], where
            assert not math.isfinite(run["norms"][cases.BAD_STEP]), where
            others = [n for s, n in enumerate(run["norms"]) if s != cases.BAD_STEP]
            assert all(math.isfinite(n) for n in others), where
            kinds = {key.split(".")[1] for key in run["unchanged"]}
            assert kinds == {"params", "master", "exp_avg", "exp_avg_sq", "step"}, where
            touched = [key for key, same in run["unchanged"].items() if not same]
            assert not touched, (where, touched)
            # The check can fail: a normal step changes every one of those tensors.
            still = [key for key, moved in result["clean"]["changed"].items() if not moved]
            assert not still, (where, still)


def test_later_training_equals_a_run_that_never_saw_the_batch(
    ranks: list[list[dict[str, Any]]],
) -> None:
    for rank, results in enumerate(ranks):
        for result in results:
            where, run, clean = f"rank {rank} {_name(result)}", result["run"], result["clean"]
            kept = [loss for s, loss in enumerate(run["losses"]) if s != cases.BAD_STEP]
            assert kept == clean["losses"], where  # exactly: same layout, same arithmetic
            assert run["norms"][: cases.BAD_STEP] == clean["norms"][: cases.BAD_STEP], where
            assert run["norms"][cases.BAD_STEP + 1 :] == clean["norms"][cases.BAD_STEP :], where
            assert run["adam_steps"] == clean["adam_steps"] == cases.STEPS - 1, where
            differs = [key for key, same in run["final_as_clean"].items() if not same]
            assert not differs, (where, differs)
            if result["fault"] == "nan_loss":
                assert math.isnan(run["losses"][cases.BAD_STEP]), where
