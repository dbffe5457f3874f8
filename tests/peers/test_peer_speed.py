"""The alternated timing harness (benchmarks/compare/alternated.py, benchmarks/speed/
peer_speed.py) measures what it says: every system runs in every position of a round's
order equally often, a round's ratio pairs the two systems' blocks of that round (the
slowest rank's wall time, the ranks' mean CPU time), and the systems built side by side in
one process train the same model on the same data (ours and the plain loop: the same
losses)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` imports

from benchmarks.compare import alternated
from benchmarks.compare.common import BenchConfig, JobSpec
from benchmarks.speed.peer_speed import per_round, ratio, tight


def test_every_system_runs_in_every_position_equally_often() -> None:
    systems = list(range(3))
    orders = [alternated.rotated(systems, r) for r in range(6)]
    for position in range(3):
        assert sorted(order[position] for order in orders) == [0, 0, 1, 1, 2, 2]


def test_a_rounds_ratio_pairs_that_rounds_blocks() -> None:
    def block(r: int, system: int, wall: float, cpu: float) -> dict:
        return {"round": r, "system": system, "wall": wall, "cpu": cpu, "faults": 0}

    rank0 = [block(0, 0, 1.0, 1.0), block(0, 1, 2.0, 2.0), block(1, 1, 4.0, 3.0)]
    rank1 = [block(0, 0, 3.0, 2.0), block(0, 1, 1.0, 1.0), block(1, 1, 1.0, 1.0)]
    rank0 += [block(1, 0, 2.0, 2.0)]
    rank1 += [block(1, 0, 1.0, 1.0)]
    result = {"rounds": 2, "blocks": [rank0, rank1]}
    assert per_round(result, 0, "wall") == [3.0, 2.0]  # the slowest rank
    assert per_round(result, 0, "cpu") == [1.5, 1.5]  # the ranks' mean
    assert ratio(result, 0, 1, "wall") == (1.0, 0.5, 1.5)  # 3/2 and 2/4, median 1.0
    assert not tight((1.0, 0.5, 1.5)) and tight((1.0, 0.96, 1.04))


@pytest.mark.timeout(120)
def test_ours_and_the_plain_loop_side_by_side_train_the_same_model(tmp_path: Path) -> None:
    bench = BenchConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, global_batch=4, steps=2)
    specs = [JobSpec("ours", bench=bench), JobSpec("plain", bench=bench)]
    out = tmp_path / "job.json"
    alternated.run(specs, rounds=2, block=1, out=out)
    result = json.loads(out.read_text())
    ours, plain = result["losses"]
    assert len(ours) == len(plain) == bench.warmup + 2
    assert ours == pytest.approx(plain, rel=1e-5)  # fp32, same weights and batches
    assert {(b["round"], b["system"]) for b in result["blocks"][0]} == {
        (r, s) for r in range(2) for s in range(2)
    }
