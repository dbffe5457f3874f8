"""bf16 compute with fp32 master weights tracks fp32 training (launch.pretrain, 100 steps):
the mean loss over the last 50 steps within 2%."""

from __future__ import annotations

import json
from pathlib import Path

from small_run import TINY_CONFIG, small_run_overrides

from launch import pretrain


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_bf16_loss_within_2_percent_of_fp32_over_100_steps(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    finals = {}
    for precision in ("fp32", "bf16"):
        run_dir = tmp_path / precision
        overrides = small_run_overrides(small_corpus, cache_dir, run_dir)
        overrides += [
            f"train.precision={precision}",
            "train.steps=100",
            "train.eval_every=100",
            "parallel.zero_stage=2",
            "sample.tokens=0",
        ]
        assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0
        losses = _losses(run_dir)
        assert len(losses) == 100
        finals[precision] = sum(losses[50:]) / 50
    # it learned something: the loss fell by a fifth
    assert finals["fp32"] < 0.8 * _losses(tmp_path / "fp32")[0]
    # Both runs see the same batches, so the mean over the second half (50 steps) compares
    # the two precisions, not the batches. Not the last 10 steps: by step 100 a run can
    # have taken another branch of the loss surface. Over seeds 1-9 and 1234 the last-10
    # gap was within 0.6% for 8 seeds, but 2.3% and -1.9% for two; the second-half gap
    # was within 1.6% for all ten.
    assert abs(finals["bf16"] - finals["fp32"]) <= 0.02 * finals["fp32"], finals
