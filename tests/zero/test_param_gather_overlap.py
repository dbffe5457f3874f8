"""ZeRO stages 1-2 overlap the parameter all-gather after the step with the next forward
(hybrid.zero.publish; Megatron's overlap-param-gather), and nothing else changes: the
losses, an eval under no_grad and the final weights are bitwise those of the same run
waiting for every gather in the step (fp32, dp=2, one bucket per layer). The overlap is
seen from outside, in torch.profiler's record: forward matrix products start while a
gather is in flight (gloo's all-gather, or the receives of the pairwise exchange the engine
uses on gloo: hybrid.distributed.pairwise), and none do when the step waits."""

from __future__ import annotations

import overlap_cases
import pytest
import torch

from hybrid.instruments.local_processes import run_processes


@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_overlap_forward_and_change_nothing(stage: int) -> None:
    ranks = run_processes(overlap_cases.train, 2, stage)
    for rank, (a, b) in enumerate((runs[True], runs[False]) for runs in ranks):
        assert a["buckets"] == overlap_cases.CONFIG.n_layer + 1
        assert a["losses"] == b["losses"], rank
        assert a["eval"] == b["eval"], rank
        assert a["weights"].keys() == b["weights"].keys()
        for name, value in a["weights"].items():
            assert torch.equal(value, b["weights"][name]), (rank, name)
        assert a["overlapping"] > 0, (rank, a["overlapping"])
        assert b["overlapping"] == 0, rank
    assert len(set(ranks[0][True]["losses"])) == overlap_cases.STEPS  # the run trains
