"""Checkpoints in a training run: where they go, resuming, saving.

Saved with a checkpoint (hybrid.checkpoint): model and optimizer shards, the step, the
global sample index of the data, the fp16 loss scale, the resolved config and each rank's
random states. Resuming at another layout is allowed (the shards reshard on load and the
sample index is global); the random states are restored only at the same layout, where
per-rank streams mean the same thing.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from hybrid.checkpoint import load_checkpoint, save_checkpoint
from hybrid.checkpoint_files import CheckpointError, check_checkpoint, complete_checkpoints
from hybrid.engine import Engine
from hybrid.tensor_parallel import TensorParallel
from hybrid.topology import Topology

from .config import Config, ConfigError, to_dict


def checkpoint_root(config: Config) -> Path:
    return Path(config.checkpoint.dir or Path(config.run_dir) / "checkpoints")


def resume_from(config: Config) -> Path | None:
    """The checkpoint to resume from, checked before any process group exists."""
    resume = config.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        return _newest_loadable(checkpoint_root(config))
    try:
        check_checkpoint(Path(resume))
    except CheckpointError as error:
        raise ConfigError(f"checkpoint.resume: {error}") from None
    return Path(resume)


def _newest_loadable(root: Path) -> Path | None:
    """The newest complete checkpoint whose files check out; a damaged one (a shard
    missing or truncated) is skipped with a warning. None when there is none at all; an
    error when there are checkpoints but none loads, rather than silently starting over."""
    candidates = complete_checkpoints(root) if root.is_dir() else []
    problems = []
    for candidate in reversed(candidates):
        try:
            check_checkpoint(candidate)
        except CheckpointError as error:
            print(f"warning: not resuming from {candidate}: {error}", file=sys.stderr)
            problems.append(str(error))
            continue
        return candidate
    if problems:
        raise ConfigError(
            f"no checkpoint in {root} can be loaded ({problems[0]}); repair it, or start "
            "afresh with checkpoint.resume=none and another checkpoint.dir"
        )
    return None


def restore(
    path: Path, engine: Engine, config: Config, topology: Topology, tp: TensorParallel
) -> dict[str, Any]:
    """Load `path` into the engine; returns its trainer state (step, consumed_samples)."""
    saved = check_checkpoint(path, verify_checksums=False)  # resume_from verified it
    ours, theirs = dataclasses.asdict(engine.module.config), saved["config"]["model"]
    different = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if different:
        shown = ", ".join(f"model.{k}: {a} there, {b} here" for k, (a, b) in different.items())
        raise ConfigError(f"checkpoint {path} holds another model ({shown})")
    state, rng = load_checkpoint(engine, path)
    engine.set_adam_steps(state["adam_steps"])
    engine.loss_scale = state["loss_scale"]
    # fp16: the good steps since the scale last changed, so that the scale grows at the
    # step an uninterrupted run's would (absent from older checkpoints).
    engine.good_steps = state.get("good_steps", 0)
    if rng is not None and state["layout"] == _layout(topology):
        torch.set_rng_state(rng["default"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], engine.device)
        tp.rng.state = rng["tp"]
    return state


def save(
    engine: Engine,
    config: Config,
    step: int,
    consumed_samples: int,
    topology: Topology,
    tp: TensorParallel,
) -> Path:
    state = {
        "step": step,
        "consumed_samples": consumed_samples,
        "adam_steps": engine.adam_steps,
        "loss_scale": engine.loss_scale,
        "good_steps": engine.good_steps,
        "layout": _layout(topology),
        "config": to_dict(config) | {"model": dataclasses.asdict(engine.module.config)},
    }
    rng = {"default": torch.get_rng_state(), "tp": tp.rng.state}
    if engine.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.device)
    return save_checkpoint(
        engine, checkpoint_root(config), step, state, rng, config.checkpoint.keep
    )


def _layout(topology: Topology) -> dict[str, int]:
    return {"world_size": topology.world_size, "tp": topology.tp}
