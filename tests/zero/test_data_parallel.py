"""Data parallelism: 2 processes on gloo train exactly like one process on the same global batch.

Tolerance: 1e-5 relative on every step's loss (fp32, dropout 0). Summation order differs
(two half-batch gradients averaged by all-reduce vs one full-batch gradient), which moves
the last bits; anything structural (wrong sharding, double counting, missing reduction)
moves the loss by far more than 1e-5 within a few steps at this learning rate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from small_run import TINY_CONFIG, small_run_overrides

from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from launch.config import load_config, validate_layout
from launch.pretrain import train


def _overrides(corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    extra = ["train.steps=8", "train.eval_every=4", "train.eval_batches=1", "sample.tokens=0"]
    return small_run_overrides(corpus, cache, run_dir) + extra


def _train(overrides: list[str]) -> list[dict]:
    config = load_config(TINY_CONFIG, overrides)
    dp = validate_layout(config, world_size_from_env())
    env = init_distributed()
    try:
        return train(config, env, dp)
    finally:
        shutdown(env)


def test_two_ranks_match_single_process(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    from hybrid.instruments.local_processes import run_processes

    single = _train(_overrides(small_corpus, cache_dir, tmp_path / "single"))
    ranks = run_processes(_train, 2, _overrides(small_corpus, cache_dir, tmp_path / "dp2"))
    # Every rank reports the same global-batch loss.
    assert [m["loss"] for m in ranks[0]] == [m["loss"] for m in ranks[1]]
    parallel = ranks[0]
    assert len(single) == len(parallel) == 8
    for reference, measured in zip(single, parallel, strict=True):
        assert measured["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert measured["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
        if "val_loss" in reference:
            assert measured["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    # The model learned something: the comparison is not between two constant runs.
    assert parallel[-1]["loss"] < parallel[0]["loss"] - 0.1
