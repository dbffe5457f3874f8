"""`checkpoint.keep`: only the newest `keep` complete checkpoints stay (with `latest`
pointing at the newest), the older ones are deleted from disk, and a rerun resumes from
the newest to the losses of a run that never stopped (README, "Checkpoints")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from small_run import TINY_CONFIG, small_run_overrides

from launch import pretrain


def _run(overrides: list[str]) -> None:
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0


def _listing(root: Path) -> list[str]:
    """Everything in the checkpoint folder: pruning may leave no temporary folder behind.
    Pruned checkpoints are renamed `.trash-*` at once and deleted by a thread: given up to
    10 s to be gone from the disk."""
    deadline = time.monotonic() + 10
    while any(p.name.startswith(".trash-") for p in root.iterdir()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return sorted(p.name for p in root.iterdir())


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(row["step"], row["loss"]) for row in map(json.loads, lines)]


def test_only_the_newest_keep_checkpoints_remain_and_resume_uses_the_newest(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint after every step with keep=2: stopped after step 5, steps 4 and 5
    remain (1-3 were written, then pruned); the rerun resumes at step 5, not 4, and ends
    with steps 6 and 7 the only ones left."""

    def overrides(run_dir: Path, *extra: str) -> list[str]:
        base = small_run_overrides(small_corpus, cache_dir, run_dir)
        return [*base, "train.steps=7", "train.eval_every=7", "sample.tokens=0", *extra]

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    kept = ["checkpoint.every=1", "checkpoint.keep=2"]
    _run(overrides(run_dir, *kept, "train.stop_at=5"))
    assert _listing(root) == ["latest", "step_00000004", "step_00000005"]
    assert (root / "latest").read_text() == "step_00000005"
    capsys.readouterr()

    _run(overrides(run_dir, *kept))
    assert f"resuming from {root / 'step_00000005'} at step 5" in capsys.readouterr().out
    assert _listing(root) == ["latest", "step_00000006", "step_00000007"]
    assert (root / "latest").read_text() == "step_00000007"

    _run(overrides(tmp_path / "straight"))
    assert _losses(run_dir) == _losses(tmp_path / "straight")  # steps 1-7, exactly
