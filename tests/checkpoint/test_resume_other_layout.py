"""`checkpoint.resume=<folder>` of a checkpoint saved at another layout, through
launch.pretrain's training (README, "Checkpoints": the stored tensors are in tp=1 shapes,
so a checkpoint loads under any tp, dp and ZeRO stage with no conversion step).

A run at dp=2, ZeRO stage 1 stops after step 3; the same run straight through gives the
reference losses of steps 4-6. Resumed from the folder of step 3 at tp=2 x dp=1 (stage 0)
and at dp=1 (stage 3, one process), each run starts at step 4 and its losses are the
reference's within 1e-5 relative (fp32; a different layout sums in another order). The
first step checks the weights and the data position (a global sample index), the
following ones Adam's moments and step count too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from small_run import TINY_CONFIG, small_run_overrides

from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from hybrid.instruments.local_processes import run_processes
from launch import pretrain
from launch.config import load_config, validate_layout
from launch.train.checkpointing import resume_from
from launch.train.loop import train

SAVED = "step_00000003"


def _overrides(corpus: Path, cache: Path, run_dir: Path, *extra: str) -> list[str]:
    base = small_run_overrides(corpus, cache, run_dir)
    return [*base, "train.steps=6", "train.eval_every=6", "sample.tokens=0", *extra]


def _two_ranks(corpus: Path, cache: Path, root: Path) -> dict[str, list[dict[str, Any]]]:
    """In one process group of 2: the dp=2 stage-1 run straight to step 6 and stopped at
    step 3, then the tp=2 run resumed from the step-3 folder. Per run, the steps it ran
    itself (`train`'s history)."""
    env = init_distributed()
    try:
        saved = root / "dp2" / "checkpoints" / SAVED
        runs = [
            ("straight", ["parallel.zero_stage=1"]),
            ("dp2", ["parallel.zero_stage=1", "train.stop_at=3"]),
            ("tp2", ["parallel.tp=2", "parallel.zero_stage=0", f"checkpoint.resume={saved}"]),
        ]
        history = {}
        for name, extra in runs:
            config = load_config(TINY_CONFIG, _overrides(corpus, cache, root / name, *extra))
            dp = validate_layout(config, world_size_from_env())
            history[name] = train(config, env, dp, resume_from(config))
        return history
    finally:
        shutdown(env)


def test_resume_from_a_checkpoint_of_another_layout(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = run_processes(_two_ranks, 2, small_corpus, cache_dir, tmp_path)[0]
    reference = {row["step"]: row["loss"] for row in ran["straight"] if row["step"] > 3}
    assert [row["step"] for row in ran["dp2"]] == [1, 2, 3]
    saved = tmp_path / "dp2" / "checkpoints" / SAVED
    layout = json.loads((saved / "trainer_state.json").read_text())["layout"]
    assert layout == {"world_size": 2, "tp": 1}

    tp2 = {row["step"]: row["loss"] for row in ran["tp2"]}
    assert sorted(tp2) == [4, 5, 6]  # it started at the saved step
    assert tp2 == pytest.approx(reference, rel=1e-5)

    overrides = _overrides(small_corpus, cache_dir, tmp_path / "stage3")
    overrides += ["parallel.zero_stage=3", f"checkpoint.resume={saved}"]
    capsys.readouterr()
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0
    assert f"resuming from {saved} at step 3" in capsys.readouterr().out
    lines = (tmp_path / "stage3" / "metrics.jsonl").read_text().splitlines()
    stage3 = {row["step"]: row["loss"] for row in map(json.loads, lines)}
    assert sorted(stage3) == [4, 5, 6]
    assert stage3 == pytest.approx(reference, rel=1e-5)
