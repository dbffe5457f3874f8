"""2D parallelism through `launch.pretrain`: 4 processes (tp=2 x dp=2, or dp=4 with ZeRO)
train like one process.

10 AdamW steps on the same global batches; every step's loss (metrics.jsonl) within 1e-5
relative of the single-process run (fp32, dropout 0), with plain TP, with sequence
parallelism, and with each recompute mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from small_run import TINY_CONFIG, small_run_overrides

from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from hybrid.instruments.local_processes import run_processes
from launch.config import load_config, validate_layout
from launch.pretrain import train

VARIANTS = {
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2-selective": ["parallel.tp=2", "parallel.recompute=selective"],
    "tp2-sp-full": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=full"],
    "tp2-sp-full-zero3": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.recompute=full",
        "parallel.zero_stage=3",
    ],
    "dp4-zero1": ["parallel.zero_stage=1"],
    "dp4-zero2": ["parallel.zero_stage=2"],
}


def _overrides(corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    extra = ["train.steps=10", "train.eval_every=5", "train.eval_batches=1", "sample.tokens=0"]
    return small_run_overrides(corpus, cache, run_dir) + extra


def _train_all(runs: dict[str, list[str]]) -> dict[str, list[float]]:
    """Train each variant in turn in one process group; return the losses of metrics.jsonl."""
    env = init_distributed()
    try:
        losses = {}
        for name, overrides in runs.items():
            config = load_config(TINY_CONFIG, overrides)
            train(config, env, validate_layout(config, world_size_from_env()))
            metrics = Path(config.run_dir) / "metrics.jsonl"
            if env.is_main:
                losses[name] = [json.loads(line)["loss"] for line in metrics.open()]
        return losses
    finally:
        shutdown(env)


def test_tp2_dp2_matches_single_process(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    base = _overrides(small_corpus, cache_dir, tmp_path / "single")
    reference = _train_all({"single": base})["single"]
    runs = {
        name: _overrides(small_corpus, cache_dir, tmp_path / name) + extra
        for name, extra in VARIANTS.items()
    }
    results = run_processes(_train_all, 4, runs)[0]
    assert len(reference) == 10
    assert reference[-1] < reference[0] - 0.1  # it learns: the comparison is not trivial
    for name, losses in results.items():
        assert losses == pytest.approx(reference, rel=1e-5), name
