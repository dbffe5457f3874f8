"""SIGTERM to the torchrun process itself (what `scancel` or a Kubernetes eviction delivers
to a job's launcher), not to a worker: torchrun forwards it to every rank; they finish
the step under way, save one checkpoint of it together and exit on their own, well before
torchrun's shutdown timeout would kill them; the same command run again resumes from that
checkpoint (README, "Reliability"). test_reliability.py signals one worker instead.

torchrun itself does not exit 0 after a SIGTERM: torch's elastic agent re-raises the
signal as `SignalException` once its workers are gone (exit code 1 in torch 2.13), a
launcher's behaviour no training code can change.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from small_run import TINY_CONFIG, small_run_overrides

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT_S = 90  # torchrun's SIGKILL after its SIGTERM; the ranks must beat it


def _torchrun(overrides: list[str], cwd: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}", "-m", "launch.pretrain",
        "--config", str(TINY_CONFIG), *overrides,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = str(ROOT)
    # A session of its own, so a failed test can end the workers too.
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _finish(process: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
        raise AssertionError(f"torchrun did not end within {timeout} s:\n{err[-3000:]}") from None


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_sigterm_to_torchrun_saves_the_step_and_the_rerun_resumes_there(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    # 1000 steps: the job is surely still training when the signal comes.
    overrides = small_run_overrides(small_corpus, cache_dir, run_dir)
    overrides += ["train.steps=1000", "train.eval_every=1000", "sample.tokens=0"]
    process = _torchrun(overrides, tmp_path)
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert process.poll() is None, _finish(process)[1][-3000:]
        assert time.monotonic() < deadline, "no training step within 120 s"
        time.sleep(0.05)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)  # to torchrun, the process we started
    out, err = _finish(process)
    seconds = time.monotonic() - signalled

    steps = _steps(metrics)
    saved = steps[-1]
    assert steps == list(range(1, saved + 1)) and 2 <= saved < 1000
    assert f"stopped after step {saved} (SIGTERM) with a checkpoint" in out, out[-2000:]
    assert "Sending process" in err and "closing signal SIGTERM" in err  # torchrun forwarded
    # The ranks ended themselves: no worker traceback, long before torchrun's SIGKILL.
    assert seconds < SHUTDOWN_TIMEOUT_S / 2, seconds
    assert err.count("Traceback") == 1 and "SignalException" in err, err[-3000:]
    assert process.returncode == 1  # torchrun's own re-raised SignalException
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == f"step_{saved:08d}"
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step_{saved:08d}"]

    # The same command, stopping two steps later (stop_at keeps the schedule of 1000).
    rerun = _torchrun([*overrides, f"train.stop_at={saved + 2}"], tmp_path)
    out, err = _finish(rerun)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resuming from {root / f'step_{saved:08d}'} at step {saved}" in out, out[-2000:]
    assert f"stopped after step {saved + 2} (train.stop_at)" in out
    assert _steps(metrics) == list(range(1, saved + 3))
