"""Worker functions for the checkpoint tests: train, save, load at another layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tp_cases import in_process_group
from zero_cases import CLIP, CONFIG, GLOBAL_BATCH, LR, MICRO, WEIGHT_DECAY, global_batches

from hybrid.checkpoint.engine_state import gather_full_states, load_checkpoint, save_checkpoint
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT


def build(
    tp: int, stage: int, seed: int, sequence_parallel: bool = False
) -> tuple[Engine, Topology]:
    topology = Topology.build(tp)
    parallel = TensorParallel.from_topology(topology, seed, sequence_parallel)
    recompute = RecomputePolicy(Recompute.FULL if stage == 3 else Recompute.NONE)
    model = GPT(CONFIG, parallel, recompute, seed=seed)
    config = EngineConfig(
        zero_stage=stage,
        micro_batches=GLOBAL_BATCH // topology.dp // MICRO,
        grad_clip=CLIP,
        weight_decay=WEIGHT_DECAY,
    )
    return Engine(model, topology, parallel, config, units=list(model.blocks)), topology


def train_steps(engine: Engine, topology: Topology, steps: range) -> list[float]:
    per_rank = GLOBAL_BATCH // topology.dp
    losses = []
    batches = global_batches()
    for step in steps:
        mine = batches[step][topology.dp_rank * per_rank : (topology.dp_rank + 1) * per_rank]
        total = torch.zeros(())
        for micro in mine.split(MICRO):
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            total += loss.detach() / engine.config.micro_batches
        engine.step(LR)
        losses.append(float(topology.dp_group.all_reduce(total) / topology.dp))
    return losses


def run(
    tp: int,
    stage: int,
    steps: range,
    load_from: Path | None = None,
    save_to: Path | None = None,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """Optionally load, train `steps`, optionally save; returns losses and full states
    (the states as loaded, before training, when loading)."""

    def work() -> dict[str, Any]:
        # A different seed when loading: the checkpoint, not the init, must decide.
        seed = 3 if load_from is None else 99
        engine, topology = build(tp, stage, seed, sequence_parallel)
        assert engine.tp.sequence_parallel == sequence_parallel
        out: dict[str, Any] = {}
        if load_from is not None:
            state, _ = load_checkpoint(engine, load_from)
            engine.set_adam_steps(state["adam_steps"])
            out["loaded"] = gather_full_states(engine)
            out["weights"] = engine.full_state_dict()
        out["losses"] = train_steps(engine, topology, steps)
        if save_to is not None:
            save_checkpoint(
                engine, save_to, steps.stop, {"adam_steps": engine.adam_steps}, {}, keep=2
            )
            out["saved"] = gather_full_states(engine)
        return out

    return in_process_group(work)
