"""hybrid.distributed.pairwise: ZeRO's all-gather, and its reduce-scatter in a group of two, as
direct exchanges on gloo's point-to-point sends (hybrid.distributed.comm.Group uses them on
gloo), held against independent references in 2- and 4-process gloo jobs:
- the all-gather is the concatenation of every rank's shard, bit for bit, in place and not;
- the 2-rank reduce-scatter equals gloo's own reduce_scatter bit for bit (fp32 and bf16),
  and the fp64 sum of the two inputs within fp32 rounding;
- four exchanges in flight at once, waited for in reverse, each get their own messages;
- torch's dispatcher (hybrid.instruments.dispatch_counters) sees point-to-point sends, not gloo's
  collectives, and the bytes they send equal a ring's share, S (n-1)/n, which the library's
  own counter and the planner assume; at 4 ranks the reduce-scatter stays gloo's own;
- the pairwise reduce-scatter refuses more than two ranks;
- exchanges dropped un-waited do not stall the group (a barrier and an exchange after).
"""

from __future__ import annotations

from typing import Any

import pairwise_cases
import pytest
import torch
from pairwise_cases import SHARD, inputs

from hybrid.instruments.local_processes import run_processes

FP32_UNIT = 2.0**-24


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_processes(pairwise_cases.exchanges, request.param, timeout_s=120)


def test_all_gather_is_the_concatenation(ranks: list[dict[str, Any]]) -> None:
    expected = torch.cat([r["shard"] for r in ranks])
    for r in ranks:
        assert torch.equal(r["gathered"], expected), r["rank"]
        assert torch.equal(r["gathered_in_place"], expected), r["rank"]
        assert torch.equal(r["gathers"][0], expected), r["rank"]
        assert torch.equal(r["gathers"][1], torch.cat([x["shard"] * 3 for x in ranks]))


def test_reduce_scatter_matches_gloo_and_the_fp64_sum(ranks: list[dict[str, Any]]) -> None:
    size = len(ranks)
    terms = torch.stack([inputs(r, size) for r in range(size)]).double()
    total, magnitude = terms.sum(0), terms.abs().sum(0)
    for r in ranks:
        piece = slice(r["rank"] * SHARD, (r["rank"] + 1) * SHARD)
        error = (r["reduced"].double() - total[piece]).abs()
        assert (error <= size * FP32_UNIT * magnitude[piece]).all(), r["rank"]
        assert torch.equal(r["reduced_twice"], r["reduced"] * 2), r["rank"]
        if size == 2:
            assert torch.equal(r["reduced"], r["gloo_reduced"]), r["rank"]
            assert r["bf16_equal"], r["rank"]


def test_dispatcher_sees_sends_of_a_rings_bytes(ranks: list[dict[str, Any]]) -> None:
    size = len(ranks)
    full = size * SHARD * 4  # bytes of one flat fp32 tensor
    for r in ranks:
        assert r["pairwise"], r["rank"]
        # Our own counter, by the collectives' convention (hybrid.distributed.comm).
        assert r["counter"] == {("reduce_scatter", "dp"): 2 * full, ("all_gather", "dp"): 2 * full}
        calls = r["trace_calls"]
        if size == 2:  # everything pairwise: 2 x (1 + 1) sends, no gloo collective
            assert calls == {("send", "dp"): 4}, calls
            assert r["trace_sent"] == {("send", "dp"): 4 * full / 2}
        else:  # gathers pairwise (3 sends each), reduce-scatters gloo's own
            assert calls == {("send", "dp"): 6, ("reduce_scatter", "dp"): 2}, calls
            sent = r["trace_sent"]
            assert sent[("send", "dp")] == 2 * full * (size - 1) / size
            assert sent[("reduce_scatter", "dp")] == 2 * full * (size - 1) / size
            assert "for 2 ranks, not 4" in r["refused"]


@pytest.mark.parametrize("size", [2, 4])
def test_exchanges_dropped_in_flight_do_not_stall_the_group(size: int) -> None:
    """A send or receive freed in flight leaves gloo's transport spinning: the barrier
    after it never returned (measured, before `PairwiseWork` finished what it drops)."""
    ranks = run_processes(pairwise_cases.dropped, size, timeout_s=60)
    expected = torch.cat([torch.full((SHARD,), float(r + 1)) for r in range(size)])
    assert all(torch.equal(r["gathered"], expected) for r in ranks)
