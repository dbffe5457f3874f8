"""End to end: `torchrun -m launch.pretrain` as a user runs it, with W&B offline."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from small_run import TINY_CONFIG, small_run_overrides
from wandb_log import history

from launch import pretrain
from launch.config import load_config
from launch.planning.memory_check import format_bytes, planned_peak, run_model
from models.gpt import count_parameters

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}
KEYS |= {"peak_mem_bytes", "planned_peak_bytes"}
MiB = 2**20


def _run(args: list[str], nproc: int | None, cwd: Path) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "launch.pretrain"]
    if nproc:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "launch.pretrain",
        ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        launcher + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_pretrain_two_ranks_writes_metrics_and_offline_wandb(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(small_corpus, cache_dir, run_dir)
    overrides += ["train.steps=6", "train.eval_every=3", "tracking.wandb.mode=offline"]
    result = _run(["--config", str(TINY_CONFIG), *overrides, "sample.tokens=20"], 2, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--- sample (20 tokens) ---" in result.stdout
    assert "done: 6 steps" in result.stdout

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r.keys() >= KEYS for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [1, 3, 6]
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "config.yaml").is_file()
    _check_memory_figures(rows, result.stdout, overrides)

    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "one offline W&B run in the run folder"
    logged = history(runs[0])
    assert [r["_step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in logged] == [r["loss"] for r in rows]
    assert [r["_step"] for r in logged if "val_loss" in r] == [1, 3, 6]


def _check_memory_figures(rows: list[dict], stdout: str, overrides: list[str]) -> None:
    """Each line: the largest rank's peak so far, measured, beside the planner's peak."""
    config = load_config(TINY_CONFIG, overrides)
    model = run_model(config, 320)  # the test corpus's BPE, as the run sizes its vocabulary
    planned = int(planned_peak(config, model, 2).memory["peak"])
    assert {r["planned_peak_bytes"] for r in rows} == {planned}
    peaks = [r["peak_mem_bytes"] for r in rows]
    # A high-water mark (the kernel's RSS counters may lag by a few pages).
    assert all(b >= a - MiB for a, b in itertools.pairwise(peaks)), peaks
    # Fresh processes: at least the fp32 parameters, gradients and Adam's two moments that
    # each rank holds at stage 0 (16 bytes a parameter); and far below a worker's own size
    # (about 400 MiB of imports: the baseline, had it been logged instead).
    assert 16 * count_parameters(model) < peaks[0] < 256 * MiB, peaks
    summary = next(line for line in stdout.splitlines() if line.startswith("done: "))
    ranks = re.search(r"peak memory ([0-9.]+) MiB \(ranks ([0-9.]+) MiB, ([0-9.]+) MiB\)", summary)
    assert ranks, summary
    assert float(ranks.group(1)) == max(float(ranks.group(2)), float(ranks.group(3)))
    assert float(ranks.group(1)) * MiB >= peaks[-1] - 0.1 * MiB  # the whole run's
    assert f"planned {format_bytes(planned)}" in summary


def test_bad_override_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (main() is what `python -m launch.pretrain` runs): what it prints and
    returns, with no traceback."""
    monkeypatch.chdir(tmp_path)
    assert pretrain.main(["--config", str(TINY_CONFIG), "train.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: unknown config key 'train.lrr'; did you mean 'train.lr'?"
    assert pretrain.main(["--config", str(TINY_CONFIG), "data.files=[nope.txt]"]) == 2
    err = capsys.readouterr().err
    assert "nope.txt does not exist" in err and "Traceback" not in err


def test_vocab_smaller_than_tokenizer_is_refused(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = small_run_overrides(small_corpus, cache_dir, tmp_path / "run")
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides, "model.vocab_size=256"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size=256 is smaller than the tokenizer's 320 tokens" in err
    assert "Traceback" not in err


def test_bf16_on_a_cpu_without_native_kernels_warns_at_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GEMM probe (launch.observe.matmul_rate) patched to report AVX2's rates: the run's
    first line warns, before the checks (here a missing file stops it); fast bf16: silent."""
    import torch

    import launch.observe.matmul_rate as matmul_rate

    rates = {torch.bfloat16: 0.8, torch.float32: 50.0}
    monkeypatch.setattr(matmul_rate, "matmul_gflops", lambda dtype, *args, **kw: rates[dtype])
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(TINY_CONFIG), "train.precision=bf16", "data.files=[nope.txt]"]
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "warning: bf16 matmul here: 0.8 GFLOP/s against 50.0 GFLOP/s in fp32 (no native bf16 "
        "matrix kernels): this bf16 run will be slow here; train.precision=fp32 runs faster\n"
    ), err
    rates[torch.bfloat16] = 80.0
    assert pretrain.main(argv) == 2
    assert "warning" not in capsys.readouterr().err
