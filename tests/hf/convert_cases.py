"""Worker functions of the conversion tests (tests/hf/test_convert.py), in a module light to
import: each child process imports it, and transformers is not needed there."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from tp_cases import in_process_group

from hybrid.checkpoint.engine_state import gather_full_states, load_checkpoint, save_checkpoint
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig


def tp2_stage3_engine(checkpoint: Path) -> tuple[Engine, Topology, GPTConfig]:
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    config = GPTConfig(**saved["config"]["model"])
    topology = Topology.build(2)
    tp = TensorParallel.from_topology(topology, 0)
    model = GPT(config, tp, device="meta", seed=5)  # the checkpoint, not this init, decides
    return (
        Engine(model, topology, tp, EngineConfig(zero_stage=3), list(model.blocks)),
        topology,
        config,
    )


def reshard(jobs: dict[str, tuple[str, str]]) -> None:
    """Each checkpoint loaded at tp=2, ZeRO stage 3, and saved again from there."""

    def work() -> None:
        for checkpoint, root in jobs.values():
            engine, _, _ = tp2_stage3_engine(Path(checkpoint))
            state, _ = load_checkpoint(engine, Path(checkpoint))
            save_checkpoint(engine, Path(root), 1, state, {}, keep=1)

    in_process_group(work)


def resume_without_moments(checkpoint: str) -> dict[str, Any]:
    """At tp=2 x dp=2, ZeRO stage 3: load a checkpoint that has no Adam moments (the
    messages it prints), then one training step."""

    def work() -> dict[str, Any]:
        engine, topology, config = tp2_stage3_engine(Path(checkpoint))
        messages = io.StringIO()
        with (
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(messages),
            contextlib.redirect_stderr(messages),
        ):
            warnings.simplefilter("always")
            load_checkpoint(engine, Path(checkpoint))
        loaded = gather_full_states(engine)
        ids = torch.randint(
            0, config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(3)
        )
        mine = ids[topology.dp_rank * 2 : topology.dp_rank * 2 + 2]
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step(1e-3)
        return {
            "messages": messages.getvalue() + "".join(str(w.message) for w in caught),
            "loaded": loaded,
            "loss": loss.item(),
            "trained": gather_full_states(engine),
        }

    return in_process_group(work)
