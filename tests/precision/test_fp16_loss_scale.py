"""fp16's dynamic loss scale: it doubles after `loss_scale_window` good steps in a row,
halves on an overflow (which skips the update and starts the count again), and a resumed
run goes on with the scale its checkpoint saved, not the initial one.

fp16 runs on CPU here: the command line refuses it without CUDA (launch.train.entry), but the
Engine and `launch.train.loop.train` do not care where they run, and scaling is arithmetic.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import zero_cases
from small_run import TINY_CONFIG, small_run_overrides

import launch.train.loop
import launch.train.setup
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from launch.config import load_config, validate_layout
from launch.train.checkpointing import resume_from
from models.gpt import GPT


def test_scale_doubles_after_the_window_and_halves_on_overflow() -> None:
    """Window 3 from 1024: three good steps double it; an overflow at step 5 halves it and
    skips the update; the count restarts, so it doubles again three good steps later (a
    count that did not restart would double after two)."""
    topology = Topology.single()
    tp = TensorParallel.from_topology(topology, zero_cases.SEED)
    model = GPT(zero_cases.CONFIG, tp, seed=zero_cases.SEED)
    config = EngineConfig(precision="fp16", initial_loss_scale=1024.0, loss_scale_window=3)
    engine = Engine(model, topology, tp, config, units=list(model.blocks))
    scales, skipped, changed = [], [], []
    for step, batch in enumerate(zero_cases.global_batches()[:8]):
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss * float("inf") if step == 4 else loss)
        before = model.blocks[0].mlp.fc.weight.detach().clone()
        stats = engine.step(zero_cases.LR)
        scales.append(engine.loss_scale)
        skipped.append(stats.skipped)
        changed.append(not torch.equal(before, model.blocks[0].mlp.fc.weight.detach()))
    assert scales == [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048]
    assert skipped == [False] * 4 + [True] + [False] * 3
    assert changed == [not s for s in skipped]


def _saved_scales(run_dir: Path) -> dict[int, float]:
    """The loss scale in each checkpoint left under `run_dir` (keep=3: steps 4-6)."""
    states = [
        json.loads((folder / "trainer_state.json").read_text())
        for folder in sorted((run_dir / "checkpoints").glob("step_*"))
    ]
    return {state["step"]: state["loss_scale"] for state in states}


def test_resumed_run_restores_the_saved_loss_scale(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch.train.loop with fp16 from 1024 and a window of 2 (the Engine's settings,
    patched from outside as tests/reliability/fault_entry.py does), 6 steps with a checkpoint each.
    Stopped after 3 good steps, the checkpoint holds 2048 (doubled after step 2) and the
    resumed run starts from 2048, not 1024; and it grows when a run that never stopped does
    (after step 4: four good steps in a row), so the count of good steps since the last
    change is restored too, not restarted at zero."""
    monkeypatch.setattr(
        launch.train.setup,
        "EngineConfig",
        functools.partial(EngineConfig, initial_loss_scale=1024.0, loss_scale_window=2),
    )
    restored: list[float] = []
    original_restore = launch.train.loop.restore

    def restore(*args: Any) -> dict[str, Any]:
        state = original_restore(*args)
        restored.append(args[1].loss_scale)  # the engine's scale once the checkpoint loaded
        return state

    monkeypatch.setattr(launch.train.loop, "restore", restore)
    env = init_distributed()
    try:
        for name, more in [("straight", []), ("resumed", ["train.stop_at=3"]), ("resumed", [])]:
            overrides = small_run_overrides(small_corpus, cache_dir, tmp_path / name)
            overrides += ["train.precision=fp16", "train.steps=6", "train.eval_every=6"]
            overrides += ["sample.tokens=0", "checkpoint.every=1", *more]
            config = load_config(TINY_CONFIG, overrides)
            launch.train.loop.train(config, env, validate_layout(config, 1), resume_from(config))
    finally:
        shutdown(env)

    losses = {}
    for name in ("straight", "resumed"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], name
        assert not any(r.get("skipped") for r in rows), name  # no overflow: only growth
        losses[name] = [r["loss"] for r in rows]
    assert losses["resumed"] == losses["straight"]  # exactly: one layout, on CPU
    assert restored == [2048.0]  # from step 3's checkpoint, not the initial 1024
    assert _saved_scales(tmp_path / "straight") == {4: 4096.0, 5: 4096.0, 6: 8192.0}
    assert _saved_scales(tmp_path / "resumed") == _saved_scales(tmp_path / "straight")
