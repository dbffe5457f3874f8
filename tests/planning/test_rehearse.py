"""launch.rehearse: one rank of a job played by one process, its peers a fake process
group (hybrid.instruments.fake_world), held against a real 4-process gloo job of the same layout and
against the planner.

- Model states: the parameters, gradients and optimizer states rank 0 and rank 3 hold,
  built and after the last backward, measured by the same instrument (MemTracker, the
  engine's storages filed by category: hybrid.instruments.engine_memory), equal to the byte between
  the rehearsal and the real job, at ZeRO stages 0-3, tp 2, dp 2.
- The rehearsal's peak, and each category at it, within 10% of the planner's (the
  acceptance tolerance, as benchmarks/rehearsal.py checks at 17B and 175B).
- Communication: the bytes counted at torch's dispatcher equal the library's own
  CollectiveCounter's, and the ring bytes sent per step equal the planner's.
- Refusals, before any process group or tensor exists: a rank outside the world, a world
  not divisible by tp, with real compute a planned peak above the memory.
The rehearsals here run in the default mode, fake compute (test_rehearse_fake.py holds it
against real compute); the timing test runs real compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rehearse_cases import STAGES, WORLD, config, real_job

import launch.planning.rehearsal as rehearsal
from hybrid.instruments.local_processes import run_processes
from launch.config import load_config, preset_path
from launch.planning.rehearsal import Request, rehearse
from launch.rehearse import main

TOLERANCE = 0.10
STATES = ("parameters", "gradients", "optimizer")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def real() -> list[list[dict]]:
    """results[rank][stage index] of the real 4-process job."""
    return run_processes(real_job, WORLD, timeout_s=300)


@pytest.fixture(scope="module")
def rehearsed() -> dict[tuple[int, int], dict]:
    """(rank, stage) -> the rehearsal's report, for ranks 0 and 3."""
    return {
        (rank, stage): rehearse(Request(config(stage), "tiny", WORLD, rank, steps=1), CPU)
        for rank in (0, WORLD - 1)
        for stage in STAGES
    }


def test_model_states_equal_a_real_job(real: list[list[dict]], rehearsed: dict) -> None:
    for (rank, stage), report in rehearsed.items():
        actual = real[rank][STAGES.index(stage)]
        where = actual["topology"]
        assert (report["tp_rank"], report["dp_rank"]) == (where["tp_rank"], where["dp_rank"])
        for when in ("built", "after_backward"):
            for name in STATES:
                assert report[when][name] == actual[when][name], (rank, stage, when, name)
        assert report["after_backward"]["gradients"] > 0, (rank, stage)
        # Whole peaks differ only by what gloo allocates inside its collectives.
        real_peak, peak = actual["peak"]["total"], report["memory"]["total"]["measured"]
        assert abs(peak / real_peak - 1) <= TOLERANCE, (rank, stage, peak, real_peak)


def test_peak_and_categories_within_10_percent_of_the_planner(rehearsed: dict) -> None:
    for key, report in rehearsed.items():
        for name, row in report["memory"].items():
            if row["planned"] == 0:
                assert row["measured"] < 64 * 1024, (key, name, row)  # counters, indices
            else:
                assert abs(row["ratio"] - 1) <= TOLERANCE, (key, name, row)


def test_collectives_counted_at_the_dispatcher_equal_ours_and_the_plan(rehearsed: dict) -> None:
    for key, report in rehearsed.items():
        counted = {name: row["bytes"] for name, row in report["collectives"].items()}
        assert counted == report["counter_bytes"], key
        for group, row in report["communication"].items():
            assert row["planned"] > 0 and abs(row["ratio"] - 1) <= 0.01, (key, group, row)


def test_timing_and_flops_are_reported() -> None:
    report = rehearse(Request(config(0), "tiny", WORLD, 0, steps=2, compute="real"), CPU)
    t = report["time"]
    assert t["timed_steps"] == 1
    assert t["step_s"] > 0 and t["tflops"] > 0
    assert 0.8 <= t["flops_ratio"] <= 1.2, t  # torch's formulas against the planner's
    assert t["planned"]["compute_s"] == pytest.approx(t["step_s"])


def test_tied_embedding_gradients_at_the_embedding_moment() -> None:
    """A wide vocabulary next to one narrow layer: the peak is the embedding's backward,
    where autograd holds the output layer's and the embedding's weight gradients and
    their sum, three tables (hybrid.memory.peak); every category within 10%."""
    overrides = ["model.n_layer=1", "model.d_model=64", "model.n_head=2", "model.seq_len=16"]
    overrides += ["data.bpe_vocab_size=8192", "train.micro_batch_size=1"]
    overrides += ["train.global_batch_size=2", "train.precision=bf16", "parallel.zero_stage=1"]
    wide = load_config(preset_path("tiny"), overrides)
    report = rehearse(Request(wide, "tiny", 2, 0, steps=1), CPU)
    assert report["peak_moment"] == "backward, embedding"
    for name, row in report["memory"].items():
        assert row["ratio"] is not None and abs(row["ratio"] - 1) <= TOLERANCE, (name, row)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--world", "4", "--rank", "4"], "--rank 4 is outside a world of 4 ranks"),
        (["--world", "6"], "not divisible by tp=4"),
        (
            ["--world", "4", "--memory-limit", "20MiB", "--compute", "real"],
            "exceeds the 20.0 MiB --memory-limit",
        ),
    ],
)
def test_refusals_come_before_anything_is_allocated(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    def no_world(*args, **kwargs):
        raise AssertionError("a fake world was started")

    monkeypatch.setattr(rehearsal, "fake_world", no_world)
    overrides = ["parallel.tp=4", "model.n_head=4", "train.global_batch_size=8"]
    assert main(["--config", "tiny", *overrides, *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not dist.is_initialized()


def test_too_large_a_model_is_told_how_many_layers_fit(capsys: pytest.CaptureFixture) -> None:
    arguments = ["--config", "turing-nlg-17b", "--world", "256", "--compute", "real"]
    assert main([*arguments, "--memory-limit", "4GiB"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the 4.00 GiB --memory-limit; rehearse --layers" in err, err
