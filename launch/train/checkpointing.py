"""Checkpoints in a training run: where they go, resuming, saving.

Saved with a checkpoint (hybrid.checkpoint.engine_state): model and optimizer shards, the step, the
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
import torch.distributed as dist

from hybrid.checkpoint.engine_state import load_checkpoint
from hybrid.checkpoint.folders import (
    CheckpointError,
    check_checkpoint,
    check_checksums,
    complete_checkpoints,
    find_latest,
)
from hybrid.checkpoint.saver import CheckpointWriter
from hybrid.distributed.comm import Group
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine
from hybrid.tensor_parallel import TensorParallel
from launch.config import Config, ConfigError, to_dict


def checkpoint_root(config: Config) -> Path:
    return Path(config.checkpoint.dir or Path(config.run_dir) / "checkpoints")


def resume_from(config: Config) -> Path | None:
    """The checkpoint to resume from, checked and verified (`checkpoint.verify`). In a
    process group every rank calls it (the hashing is divided among them); launch.train.entry
    splits it in two: `resume_candidate` before the group exists, `verify_resume` after."""
    return verify_resume(config, resume_candidate(config))


def resume_candidate(config: Config) -> Path | None:
    """The checkpoint resume would use, its files present at their sizes (stat only:
    cheap on every rank), checked before any process group exists; its hashes are
    `verify_resume`'s."""
    resume = config.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto" and config.checkpoint.verify == "none":
        return find_latest(checkpoint_root(config))  # nothing beyond .metadata and state
    if resume == "auto":
        return _newest_loadable(checkpoint_root(config))
    try:
        check_checkpoint(Path(resume), False, config.checkpoint.verify != "none")
    except CheckpointError as error:
        raise ConfigError(f"checkpoint.resume: {error}") from None
    return Path(resume)


def verify_resume(
    config: Config, candidate: Path | None, world: Group | None = None
) -> Path | None:
    """The checkpoint to load: `candidate` once its files hash to their recorded checksums
    (verify=full; every rank calls, after the process group starts and before anything
    loads). Each file is hashed by one rank and one all-reduce per checkpoint tells all
    ranks the verdict, so with resume=auto they skip a damaged one alike, with a warning,
    for the newest older one that checks out. `world`: the ranks that share the hashing
    (launch.train.entry passes the job's; default: the whole job)."""
    verify = config.checkpoint.verify
    if candidate is not None and verify == "none":
        _warn(
            f"warning: checkpoint.verify=none: {candidate} is loaded without checking its "
            "files' checksums: an altered file would load unnoticed"
        )
    if candidate is None or verify != "full":
        return candidate
    problems: list[str] = []
    while True:
        try:
            check_checksums(candidate, among=world or Group.whole_job())
            return candidate
        except CheckpointError as error:
            if config.checkpoint.resume != "auto":
                raise ConfigError(f"checkpoint.resume: {error}") from None
            _warn(f"warning: not resuming from {candidate}: {error}")
            problems.append(str(error))
        root = checkpoint_root(config)
        candidate = _newest_loadable(root, before=candidate, problems=problems)
        if candidate is None:
            raise _none_loads(root, problems)


def _newest_loadable(
    root: Path, before: Path | None = None, problems: list[str] | None = None
) -> Path | None:
    """The newest complete checkpoint (older than `before`, if given) whose files are
    present at their sizes; a damaged one (a shard missing or truncated) is skipped with
    a warning. None when there is none at all; an error when there are checkpoints but
    none loads (`problems`: what was skipped already), rather than silently starting
    over."""
    candidates = complete_checkpoints(root) if root.is_dir() else []
    if before is not None:
        candidates = [c for c in candidates if c.name < before.name]
    problems = [] if problems is None else problems
    for candidate in reversed(candidates):
        try:
            check_checkpoint(candidate, verify_checksums=False)
        except CheckpointError as error:
            _warn(f"warning: not resuming from {candidate}: {error}")
            problems.append(str(error))
            continue
        return candidate
    if problems:
        raise _none_loads(root, problems)
    return None


def _none_loads(root: Path, problems: list[str]) -> ConfigError:
    return ConfigError(
        f"no checkpoint in {root} can be loaded ({problems[0]}); repair it, or start "
        "afresh with checkpoint.resume=none and another checkpoint.dir"
    )


def _warn(message: str) -> None:
    """On every rank before the process group exists (each decides alone), on rank 0
    after it (every rank reached the same verdict)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def restore(
    path: Path, engine: Engine, config: Config, topology: Topology, tp: TensorParallel
) -> dict[str, Any]:
    """Load `path` into the engine; returns its trainer state (step, consumed_samples)."""
    # resume_from verified it; load_checkpoint checks the files' sizes again (stat only)
    saved = check_checkpoint(path, verify_checksums=False, check_files=False)
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
    writer: CheckpointWriter,
) -> Path:
    """Checkpoint step `step` through `writer` (in the background with checkpoint.async)."""
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
    return writer.save(engine, checkpoint_root(config), step, state, rng, config.checkpoint.keep)


def _layout(topology: Topology) -> dict[str, int]:
    return {"world_size": topology.world_size, "tp": topology.tp}
