"""launch.rehearse's default mode, fake compute (hybrid.instruments.fake_compute: every op on
shapes only), against real compute on the same rank, and both against the planner:

- memory: every category at the step's peak, built and after the last backward, within 1%
  of real compute's, at ZeRO stages 0-3 with overlap_param_gather on and off (world 4,
  tp 2, dp 2, the last rank), and FLOPs counted at the dispatcher alike;
- communication: the DP and TP bytes of one step cycle within 1% of the planner's at every
  stage, in both modes, overlap on or off. `parallel.bucket_mb` is small here, so stages
  1-2 have more buckets than the publisher issues in the step (2): the gathers issued
  after it, in the next forward, must be in the window;
- the duration estimate printed before a real-compute rehearsal, and its advice, from the
  GEMM probe (patched to report a slow rate).
"""

from __future__ import annotations

import pytest
import torch
from rehearse_cases import STAGES, WORLD, config

import launch.observe.matmul_rate as matmul_rate
from launch.planning.rehearsal import Request, rehearse
from launch.rehearse import main

CPU = torch.device("cpu")
SMALL_BUCKETS = ("parallel.bucket_mb=0.05",)  # about one unit per bucket in bf16


@pytest.fixture(scope="module")
def reports() -> dict[tuple[int, bool, str], dict]:
    """(stage, overlap, compute) -> the last rank's report."""
    out = {}
    for stage in STAGES:
        for overlap in (True, False):
            c = config(stage, (*SMALL_BUCKETS, f"parallel.overlap_param_gather={overlap}"))
            for compute in ("fake", "real"):
                request = Request(c, "tiny", WORLD, WORLD - 1, steps=1, compute=compute)
                out[stage, overlap, compute] = rehearse(request, CPU)
    return out


def test_fake_compute_holds_what_real_compute_holds(reports: dict) -> None:
    for stage in STAGES:
        for overlap in (True, False):
            fake, real = reports[stage, overlap, "fake"], reports[stage, overlap, "real"]
            assert fake["compute"] == "fake" and real["compute"] == "real"
            for name, row in fake["memory"].items():
                measured = real["memory"][name]["measured"]
                assert row["measured"] == pytest.approx(measured, rel=0.01, abs=1024), (
                    stage,
                    overlap,
                    name,
                    row["measured"],
                    measured,
                )
            for when in ("built", "after_backward"):
                assert fake[when] == pytest.approx(real[when], rel=0.01), (stage, when)
            assert fake["time"]["counted_flops"] == real["time"]["counted_flops"]
            assert fake["time"]["step_s"] is None and real["time"]["step_s"] > 0


def test_bytes_of_a_step_cycle_equal_the_planner_at_every_stage(reports: dict) -> None:
    for key, report in reports.items():
        counted = {name: row["bytes"] for name, row in report["collectives"].items()}
        assert counted == report["counter_bytes"], key
        for group, row in report["communication"].items():
            assert row["planned"] > 0 and abs(row["ratio"] - 1) <= 0.01, (key, group, row)
    gathers = reports[1, True, "fake"]["collectives"]["all_gather dp"]["calls"]
    assert gathers > 2, "too few buckets: the gathers after the step would all be issued in it"


def test_a_real_compute_rehearsal_says_how_long_it_will_take(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(matmul_rate, "matmul_gflops", lambda dtype, device="cpu", size=256: 0.8)
    arguments = ["--config", "turing-nlg-17b", "--world", "256", "--compute", "real"]
    assert main([*arguments, "--memory-limit", "4GiB"]) == 2  # refused after the estimate
    out = capsys.readouterr().out
    # 2 steps of 291.6 TFLOP planned at 0.8 GFLOP/s: 1.2e4 min
    assert "bf16 matmul here: 0.8 GFLOP/s; about 12148 min for 2 steps" in out, out
    assert "use --compute fake or train.precision=fp32 for memory only" in out, out


def test_a_fake_compute_rehearsal_says_nothing_of_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def no_probe(*args, **kwargs):
        raise AssertionError("fake compute timed a matmul")

    monkeypatch.setattr(matmul_rate, "matmul_gflops", no_probe)
    assert main(["--config", "tiny", "--world", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "(fake compute)" in out and "time: not measured (--compute fake" in out, out
