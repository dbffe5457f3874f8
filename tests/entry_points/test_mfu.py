"""MFU and device memory in metrics.jsonl, the progress bar and the end summary (issue 19,
item 2). The reference for MFU is the planner's: its model FLOPs per token (read back from
the plan's own MFU and tokens/s), the logged tokens/s and the given peak."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from small_run import TINY_CONFIG, small_run_overrides

from launch import pretrain
from launch.config import WandbConfig, load_config
from launch.observe.mfu import Utilization, format_mfu, mfu, table_peak_tflops
from launch.observe.peak_memory import PeakMemory
from launch.observe.tracking import Tracker, read_metrics
from launch.planning.memory_check import format_bytes, planned_peak, run_model
from models.gpt import GPTConfig

PEAK_TFLOPS = 0.5  # a figure of a fraction of a percent on a loaded CPU
MiB = 2**20


def _run(
    small_corpus: Path, cache_dir: Path, run_dir: Path, *extra: str
) -> tuple[list[str], list[dict]]:
    overrides = small_run_overrides(small_corpus, cache_dir, run_dir)
    overrides += ["train.steps=3", "train.eval_every=3", "sample.tokens=0", *extra]
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0
    return overrides, read_metrics(run_dir / "metrics.jsonl")


def _summary(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("done: "))


def _planner_flops_per_token(overrides: list[str]) -> float:
    """The planner's model FLOPs per token for this run's model and window: its plan's MFU
    is model_flops x tokens / (seconds x gpus x peak) and its tokens/s tokens / seconds."""
    config = load_config(TINY_CONFIG, overrides)
    plan = planned_peak(config, run_model(config, 320), 1)
    assert plan.time is not None and "mfu" in plan.time
    hardware_peak = 312e12  # launch.planning.memory_check plans on the default Hardware
    return plan.time["mfu"] * 1 * hardware_peak / plan.time["tokens_per_s"]


def test_logged_mfu_is_the_planners_flops_at_the_logged_speed(
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    overrides, rows = _run(
        small_corpus, cache_dir, tmp_path / "run", f"train.peak_tflops={PEAK_TFLOPS}"
    )
    per_token = _planner_flops_per_token(overrides)
    assert per_token > 0
    for row in rows:
        expected = per_token * row["tokens_per_s"] / 1 / (PEAK_TFLOPS * 1e12)
        assert row["mfu"] == pytest.approx(expected, rel=1e-9), row
    summary = _summary(capsys.readouterr().out)
    assert f"MFU {format_mfu(statistics.median(r['mfu'] for r in rows))} (median)" in summary
    on_cuda = torch.cuda.is_available()
    assert ("device memory" in summary) == on_cuda
    assert all(("device_mem_bytes" in r) == on_cuda for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run would train on the GPU")
def test_no_mfu_on_cpu_without_a_peak(
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    _, rows = _run(small_corpus, cache_dir, tmp_path / "run")
    assert rows and all("mfu" not in r for r in rows)
    assert "MFU" not in _summary(capsys.readouterr().out)


def test_mfu_shares_the_step_over_the_world() -> None:
    """Every rank does 1/world of the step's FLOPs: 4 devices at the same tokens/s are each
    a quarter as busy."""
    model = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=384)
    one = Utilization.for_run(model, 32, 1, 2.0, torch.device("cpu"))
    four = Utilization.for_run(model, 32, 4, 2.0, torch.device("cpu"))
    assert four.of(1e6) == pytest.approx(one.of(1e6) / 4, rel=1e-12)
    assert mfu(6e9, 1e3, 4, 1.5e12) == pytest.approx(6e9 * 1e3 / 4 / 1.5e12, rel=1e-12)
    assert Utilization.for_run(model, 32, 1, None, torch.device("cpu")).of(1e6) is None
    with pytest.raises(ValueError, match=r"train.peak_tflops=0.0 must be positive"):
        Utilization.for_run(model, 32, 1, 0.0, torch.device("cpu"))


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla V100-PCIE-32GB", 112.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA RTX A1000", None),  # not an A100
        ("cpu", None),
    ],
)
def test_gpu_table_lookup(name: str, tflops: float | None) -> None:
    assert table_peak_tflops(name) == tflops


def test_mfu_prints_three_digits() -> None:
    assert [format_mfu(x) for x in (0.4123, 0.0305, 0.00026)] == ["41.2%", "3.05%", "0.026%"]


def test_bar_shows_mfu_and_memory_in_gib(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, WandbConfig(mode="disabled"), {}, 2)
    row = {"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 1e4}
    tracker.log(row | {"mfu": 0.4123, "peak_mem_bytes": 3 * 2**29})
    assert "mfu=41.2%" in tracker.progress.postfix and "mem=1.50GiB" in tracker.progress.postfix
    tracker.log(row | {"step": 2, "peak_mem_bytes": MiB, "device_mem_bytes": 5 * 2**30})
    assert "mem=5.00GiB" in tracker.progress.postfix and "mfu" not in tracker.progress.postfix
    tracker.progress.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_memory_is_the_allocators_peak(
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    device = torch.device("cuda", 0)
    memory = PeakMemory(device)
    block = torch.ones(16 * MiB // 4, device=device)
    del block
    assert memory.device_peak() == torch.cuda.max_memory_allocated(device)
    assert memory.maxima()[1] == torch.cuda.max_memory_allocated(device)

    monkeypatch.setenv("WORLD_SIZE", "1")
    _, rows = _run(small_corpus, cache_dir, tmp_path / "run")
    peak = torch.cuda.max_memory_allocated(device)  # the run reset it when it began
    figures = [r["device_mem_bytes"] for r in rows]
    assert figures == sorted(figures) and 0 < figures[-1] <= peak
    assert all(r["device_mem_bytes"] >= r["peak_mem_bytes"] for r in rows)  # + baseline
    summary = _summary(capsys.readouterr().out)
    assert f"device memory {format_bytes(peak)} (allocator peak)" in summary
    known = table_peak_tflops(torch.cuda.get_device_name(device))
    assert all(("mfu" in r) == (known is not None) for r in rows)
    assert ("MFU" in summary) == (known is not None)
