"""Faults injected into real jobs (fault_entry.py under torchrun, gloo, 1-2 ranks):
a raising rank, a hung rank, a killed rank with a restart, SIGKILL at each point of a
checkpoint save, NaN losses, SIGTERM. Each job either survives with the per-step losses of
an uninterrupted run (exactly: fp32 on CPU is deterministic at a fixed layout) or fails
fast with the failing rank's error; no checkpoint is ever lost.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_run import TINY_CONFIG, small_run_overrides

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "tests" / "reliability" / "fault_entry.py"
STEPS = 6


def _launch(
    fault: str,
    nproc: int,
    overrides: list[str],
    cwd: Path,
    restarts: int = 0,
    timeout: float = 120,
) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, str(ENTRY)]
    if nproc > 1:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", "--monitor-interval=0.5",
            "--shutdown-timeout=5",  # a cluster's grace after SIGTERM, shortened
            str(ENTRY),
        ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"PYTHONPATH": str(ROOT), "HYBRID_FAULT": fault}
    start = time.perf_counter()
    # A session of its own, so a timeout ends torchrun's workers too, not only torchrun.
    with subprocess.Popen(
        [*command, "--config", str(TINY_CONFIG), *overrides], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"{fault} did not end within {timeout} s:\n{err[-3000:]}")
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return result, time.perf_counter() - start


def _overrides(corpus: Path, cache: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *small_run_overrides(corpus, cache, run_dir),
        f"train.steps={STEPS}",
        "checkpoint.every=2",
        "sample.tokens=0",
        "model.dropout=0.1",  # a resume must restore the random state too
        *extra,
    ]


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def straight(
    small_corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, list[float]]:
    """The uninterrupted runs' losses, at 1 and 2 ranks."""
    out = {}
    for nproc in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"straight{nproc}")
        result, _ = _launch(
            "none:0:0", nproc, _overrides(small_corpus, cache_dir, run_dir), run_dir
        )
        assert result.returncode == 0, result.stderr[-3000:]
        out[nproc] = _losses(run_dir)
        assert len(out[nproc]) == STEPS
    return out


def test_a_raising_rank_ends_the_job_fast_with_its_error(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    overrides = _overrides(small_corpus, cache_dir, tmp_path / "run")
    result, seconds = _launch("raise:1:3", 2, overrides, tmp_path)
    assert result.returncode != 0
    assert seconds < 60
    assert "RuntimeError: injected fault on rank 1 at step 3" in result.stderr


def test_a_hung_rank_is_ended_by_the_collective_timeout(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 stops answering; rank 0 waits in a collective for dist_timeout_s=5, fails,
    and torchrun ends the job, well before the 60 s a test allows."""
    overrides = _overrides(small_corpus, cache_dir, tmp_path / "run", "dist_timeout_s=5")
    result, seconds = _launch("hang:1:3", 2, overrides, tmp_path)
    assert result.returncode != 0
    assert seconds < 60, seconds
    assert re.search(r"[Tt]imed? ?out", result.stderr), result.stderr[-3000:]


def test_a_killed_rank_restarts_and_resumes_to_the_same_losses(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, straight: dict[int, list[float]]
) -> None:
    run_dir = tmp_path / "run"
    overrides = _overrides(small_corpus, cache_dir, run_dir)
    result, _ = _launch("kill:1:5", 2, overrides, tmp_path, restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 4" in result.stdout  # resumed from the checkpoint of step 4
    assert "done: 2 steps" in result.stdout  # and ran only steps 5-6 (not 1-6 again)
    assert _losses(run_dir) == straight[2]


@pytest.mark.parametrize("asynchronous", ["false", "true"])
def test_saves_killed_at_every_point_resume_from_the_last_complete_checkpoint(
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    straight: dict[int, list[float]],
    asynchronous: str,
) -> None:
    """SIGKILL while a checkpoint is being written, at each point in turn, one job after
    the other in the same run folder: step 2's after its rename but before `latest` moved;
    then, resumed each time, step 4's with a shard half written, with every shard written
    but not renamed, and before any shard. Every rerun resumes from the newest complete
    checkpoint (step 2's, which is never lost), and the last one ends with the losses of a
    run that never stopped. With checkpoint.async=true the same kills land in the thread
    that writes and commits while training goes on."""
    run_dir = tmp_path / "run"
    overrides = _overrides(small_corpus, cache_dir, run_dir, f"checkpoint.async={asynchronous}")
    points: tuple[str | None, ...] = ("save-shards", "save-commit", "save-begin", None)
    if asynchronous == "true":
        # The kills that land in the save's thread (the other points are the synchronous
        # run's code): step 4's shards written, not renamed, while step 5 trains; then on.
        points = ("save-commit", None)
    else:
        first, _ = _launch("save-pointer:0:2", 1, overrides, tmp_path)
        assert first.returncode == -9, first.stderr[-3000:]
        assert not (run_dir / "checkpoints" / "latest").exists()
    for point in points:
        resumes = (run_dir / "checkpoints" / "step_00000002").is_dir()  # else a first run
        rerun, _ = _launch(f"{point}:0:4" if point else "none:0:0", 1, overrides, tmp_path)
        assert ("at step 2" in rerun.stdout) == resumes, (point, rerun.stdout[-2000:])
        assert rerun.returncode == (-9 if point else 0), (point, rerun.stderr[-3000:])
        assert (run_dir / "checkpoints" / "step_00000002" / ".metadata").is_file()
    assert "done: 4 steps" in rerun.stdout  # the last rerun ran steps 3-6 only
    assert _losses(run_dir) == straight[1]


def test_nan_loss_on_one_rank_is_skipped_everywhere_or_stops_the_job(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "skip"
    result, _ = _launch("nan:1:3", 2, _overrides(small_corpus, cache_dir, run_dir), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: step 3: NaN or inf loss or gradient" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, False, False]
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(rows) if i != 2)

    run_dir = tmp_path / "stop"
    overrides = _overrides(small_corpus, cache_dir, run_dir, "train.on_nonfinite=stop")
    result, _ = _launch("nan:1:3", 2, overrides, tmp_path)
    assert result.returncode != 0
    assert "step 3: the loss or a gradient is NaN or inf" in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
    ]


def test_sigterm_saves_at_the_end_of_the_step_and_exits_cleanly(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, straight: dict[int, list[float]]
) -> None:
    """SIGTERM reaches rank 0 only, during step 3: both ranks finish step 3, save it, and
    exit 0; the rerun goes on from step 3 to the losses of a run that never stopped."""
    run_dir = tmp_path / "run"
    overrides = _overrides(small_corpus, cache_dir, run_dir)
    result, _ = _launch("sigterm:0:3", 2, overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stopped after step 3 (SIGTERM) with a checkpoint" in result.stdout
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000003"
    rerun, _ = _launch("none:0:0", 2, overrides, tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "at step 3" in rerun.stdout and "done: 3 steps" in rerun.stdout  # steps 4-6
    assert _losses(run_dir) == straight[2]
