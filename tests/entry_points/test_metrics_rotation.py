"""metrics.jsonl across reruns into one run folder (README, "Where runs go"): a resumed run
keeps the lines up to its checkpoint's step and rewrites the later ones (no step twice); a
fresh run keeps the old file as `metrics-<date>.jsonl`, its bytes intact, and starts a new
one; and no older dated file is overwritten by a later rotation."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from small_run import TINY_CONFIG, small_run_overrides

from launch import pretrain
from launch.observe.tracking import rotate_old_metrics


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_truncates_to_the_checkpoint_and_a_fresh_run_rotates(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    base = small_run_overrides(small_corpus, cache_dir, run_dir)
    base += ["train.steps=4", "train.eval_every=4", "sample.tokens=0", "checkpoint.every=2"]

    def run(*extra: str) -> None:
        assert pretrain.main(["--config", str(TINY_CONFIG), *base, *extra]) == 0

    run()
    first = metrics.read_text().splitlines()
    assert _steps(metrics) == [1, 2, 3, 4]

    # Resumed from step 2 (an explicit folder: auto would pick step 4, the end).
    run(f"checkpoint.resume={run_dir / 'checkpoints' / 'step_00000002'}")
    resumed = metrics.read_text().splitlines()
    assert _steps(metrics) == [1, 2, 3, 4]  # 3 and 4 redone, not appended after the old 4
    assert resumed[:2] == first[:2]  # the kept lines, byte for byte
    losses = [json.loads(line)["loss"] for line in resumed]
    assert losses == [json.loads(line)["loss"] for line in first]  # the same run, resumed
    assert sorted(p.name for p in run_dir.glob("metrics*.jsonl")) == ["metrics.jsonl"]

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(metrics.stat().st_mtime))
    run("checkpoint.resume=none", "train.steps=2")
    old = run_dir / f"metrics-{stamp}.jsonl"
    assert sorted(p.name for p in run_dir.glob("metrics*.jsonl")) == [old.name, "metrics.jsonl"]
    assert old.read_text().splitlines() == resumed  # the previous run's file, kept whole
    assert _steps(metrics) == [1, 2]  # the fresh run's own lines only


def test_rotation_never_overwrites_an_older_dated_file(tmp_path: Path) -> None:
    """Two fresh runs whose files were last written in the same second (a run that fails
    at once, rerun): the second rotation must not replace the first one's file."""
    moment = time.time()
    for text in ('{"step": 1, "run": "a"}\n', '{"step": 1, "run": "b"}\n'):
        (tmp_path / "metrics.jsonl").write_text(text)
        os.utime(tmp_path / "metrics.jsonl", (moment, moment))
        rotate_old_metrics(tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()
    rotated = sorted(tmp_path.iterdir())
    assert all(re.fullmatch(r"metrics-\d{8}-\d{6}(-\d+)?\.jsonl", p.name) for p in rotated)
    assert sorted(json.loads(p.read_text())["run"] for p in rotated) == ["a", "b"]
