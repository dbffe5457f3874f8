"""Memory against the plan, from both ends of a run.

- Before start-up: a layout whose planned peak exceeds `train.memory_limit` stops
  launch.pretrain and launch.finetune with one line holding both numbers and a layout that
  fits (which itself passes every check), before any process group starts; with
  `train.memory_check=warn` the run goes on.
- During the run: the instrument (launch.observe.peak_memory) sees a tensor of known size on CPU
  above its baseline, keeps the peak after it is freed, starts again at each run, and takes
  the largest rank's; metrics.jsonl carries it beside the planner's figure.
"""

from __future__ import annotations

import re
from pathlib import Path

import finetune_cases
import pytest
import torch
from small_run import TINY_CONFIG, small_run_overrides

import launch.train.entry
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.instruments.local_processes import run_processes
from hybrid.memory import parse_bytes
from launch import finetune, pretrain
from launch.config import load_config
from launch.observe.peak_memory import PeakMemory, memory_summary
from launch.observe.tracking import read_metrics
from launch.planning.memory_check import format_bytes, planned_peak, run_model

MiB = 2**20


class Started(Exception):
    """init_distributed was reached: every check before start-up passed."""


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise Started

    monkeypatch.setattr(launch.train.entry, "init_distributed", refuse)


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_layout_above_the_limit_stops_before_start_with_one_that_fits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_start: None,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    layout = ["parallel.zero_stage=1", "parallel.recompute=selective"]  # micro-batch 8
    # The limit: what micro-batch 1 without recomputation plans. Micro-batch 1 with the
    # selective recomputation plans less, so one change fits; the fastest layout that fits
    # drops the recomputation too: two changes, not the nearest.
    smaller = load_config(
        TINY_CONFIG,
        ["parallel.zero_stage=1", "parallel.recompute=none", "train.micro_batch_size=1"],
    )
    fits = planned_peak(smaller, run_model(smaller, 512), 2).memory["total"]
    limit = f"{-(-fits // 2**10):.0f}KiB"
    args = ["--config", str(TINY_CONFIG), *layout, f"train.memory_limit={limit}"]
    assert pretrain.main(args) == 2
    line = _error_line(capsys)
    config = load_config(TINY_CONFIG, args[2:])
    planned = planned_peak(config, run_model(config, 512), 2).memory["total"]
    assert planned > parse_bytes(limit)  # the case is what it claims
    assert f"the planned peak memory per rank, {format_bytes(planned)}, exceeds" in line
    assert f"train.memory_limit={limit} ({format_bytes(parse_bytes(limit))})" in line
    assert "train.memory_check=warn" in line
    match = re.search(r"the nearest layout that fits: (.+?) \(planned ([0-9.]+ MiB)\)", line)
    assert match, line
    suggested = match.group(1).split()
    assert len(suggested) == 1, suggested  # the nearest: one option changed
    fitted = load_config(TINY_CONFIG, [*args[2:], *suggested])
    assert planned_peak(fitted, run_model(fitted, 512), 2).memory["total"] <= parse_bytes(limit)
    with pytest.raises(Started):  # the suggestion passes every check, the memory one too
        pretrain.main([*args, *suggested])
    assert not (tmp_path / "runs").exists()


def test_no_layout_fits_is_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_start: None
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain.main(["--config", str(TINY_CONFIG), "train.memory_limit=1MiB"]) == 2
    line = _error_line(capsys)
    assert "exceeds train.memory_limit=1MiB (1.0 MiB)" in line
    assert "no layout of 2 ranks fits: the smallest planned peak is" in line


def test_finetune_checks_the_limit_too(
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_start: None,
) -> None:
    tokenizer = finetune_cases.corpus_tokenizer(small_corpus, cache_dir)
    folder = finetune_cases.llama_folder(tmp_path / "llama", tokenizer)
    capsys.readouterr()  # save_pretrained's progress bars
    args = ["--config", str(finetune_cases.FINETUNE_CONFIG), f"init_from={folder}"]
    assert finetune.main([*args, "train.memory_limit=2MiB"]) == 2
    assert "exceeds train.memory_limit=2MiB (2.0 MiB)" in _error_line(capsys)
    with pytest.raises(Started):
        finetune.main([*args, "train.memory_limit=2MiB", "train.memory_check=warn"])
    assert "warning: the planned peak memory per rank" in capsys.readouterr().err


def test_warn_runs_and_metrics_carry_peak_beside_plan(
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(small_corpus, cache_dir, run_dir)
    overrides += ["train.steps=2", "sample.tokens=0", "train.memory_limit=1MiB"]
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 2
    capsys.readouterr()
    overrides.append("train.memory_check=warn")
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0
    out, err = capsys.readouterr()
    assert "warning: the planned peak memory per rank" in err
    assert "exceeds train.memory_limit=1MiB" in err and "running anyway" in err

    rows = read_metrics(run_dir / "metrics.jsonl")
    config = load_config(TINY_CONFIG, overrides)
    model = run_model(config, 320)
    planned = int(planned_peak(config, model, 1).memory["peak"])
    assert [r["planned_peak_bytes"] for r in rows] == [planned, planned]
    peaks = [r["peak_mem_bytes"] for r in rows]
    # This process's heap may hold freed pages the run reuses without growing its RSS, so
    # the figure can be near 0 here; test_pretrain_cli bounds it below in fresh processes.
    # It stays far below the process's own size (a baseline logged by mistake).
    assert all(isinstance(p, int) and 0 <= p < 256 * MiB for p in peaks), peaks
    assert re.search(rf"peak memory [0-9.]+ [KMG]?i?B, planned {format_bytes(planned)} \|", out)


def test_peak_sees_a_tensor_above_its_baseline_and_keeps_it() -> None:
    """64 MiB written on CPU: the peak above the baseline is those bytes (within what
    else the process does), stays after the tensor is freed, and a new start forgets it."""
    memory = PeakMemory(torch.device("cpu"))
    assert memory.local() < 16 * MiB
    block = torch.ones(64 * MiB // 4)  # written, so resident
    seen = memory.local()
    del block
    assert 64 * MiB <= seen < 80 * MiB, seen
    assert memory.local() >= seen - MiB  # the kernel's RSS counters lag by a few pages
    assert PeakMemory(torch.device("cpu")).local() < 16 * MiB


def _largest_rank() -> tuple[int, list[int]]:
    env = init_distributed()
    try:
        memory = PeakMemory(env.device)
        if env.rank == 1:
            block = torch.ones(64 * MiB // 4)
            del block
        return memory.max_over_ranks(), memory.per_rank()
    finally:
        shutdown(env)


def test_the_largest_rank_is_reported_on_every_rank() -> None:
    for largest, per_rank in run_processes(_largest_rank, 2):
        assert per_rank[1] >= 64 * MiB > per_rank[0], per_rank
        assert 64 * MiB <= largest <= per_rank[1]  # rank 0 too: the largest, not its own


def test_summary_names_each_rank_and_the_plan() -> None:
    text = memory_summary([41 * MiB, 40 * MiB], 12 * MiB)
    assert text == "peak memory 41.0 MiB (ranks 41.0 MiB, 40.0 MiB), planned 12.0 MiB"
    assert memory_summary([3 * 2**30], None) == "peak memory 3.00 GiB"
    assert "(ranks 1.0 MiB to 9.0 MiB)" in memory_summary([m * MiB for m in range(1, 10)], 0)
