"""Worker functions for tests/planning/test_plan_instrument.py: one optimizer step of the real
engine, measured from outside it by `torch.distributed._tools.mem_tracker.MemTracker`.

The model and engine are built inside the tracker, so it sees every tensor the step
holds, not only those the engine would name (shards, fp32 masters, gradient buffers,
reduce-scatter outputs, gathered buckets), and follows each storage's size, including
stage 3's bucket storages resized to 0 bytes and back (hybrid.zero.gather).
`track_external(model, optimizer)` then only files the parameters' storages under
"Parameter" and Adam's moments under "Optstate"; everything else built then stays
"Activation", and what backward allocates is "Temp".
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from plan_cases import pair_topologies
from torch.distributed._tools.mem_tracker import MemTracker

from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

SEED = 0
LR = 1e-3
# Layers wide next to the batch, so that model states, activations, the loss's working
# set and stage 3's gathered buckets each weigh in the peak (about 5-15 MB a rank).
MODEL = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=32, vocab_size=512)
MICRO_BATCH = 2


@dataclasses.dataclass(frozen=True)
class Case:
    stage: int
    tp: int
    recompute: str = "none"
    precision: str = "fp32"
    micro_batches: int = 1
    micro_batch: int = MICRO_BATCH
    dropout: float = 0.0
    sequence_parallel: bool = False


def model_config(case: Case | dict[str, Any]) -> GPTConfig:
    """MODEL with the case's dropout (dropout > 0: explicit attention, 1-byte masks)."""
    dropout = case["dropout"] if isinstance(case, dict) else case.dropout
    return dataclasses.replace(MODEL, dropout=dropout)


# The acceptance grid (stages 0-3 x tp 1, 2 x recompute none, full) in fp32, where stage
# 3's gathered buckets weigh most next to its shards. Then mixed precision (fp32 master,
# the step's fp32 gradients: stage 0's peak is the optimizer step), gradient
# accumulation (stage 1's full buffers over micro-batches, stage 2's shards), and larger
# micro-batches with dropout, whose peak is the loss's working set, one of them under
# sequence parallelism. The tp=1 cases are shared between the two rank pairs of the
# 4-rank job (pair_topologies), each a dp=2 job of its own.
GRID = [
    Case(stage, tp, mode) for tp in (1, 2) for stage in (0, 1, 2, 3) for mode in ("none", "full")
]
MIXED = [
    Case(0, 1, "none", "bf16"),
    Case(1, 1, "none", "bf16", micro_batches=2),
    Case(2, 1, "none", "bf16", micro_batches=2),
    Case(3, 1, "full", "bf16"),
    Case(3, 1, "none", "bf16", micro_batch=8, dropout=0.1),
    Case(0, 2, "none", "bf16", micro_batch=8, dropout=0.1),
    Case(2, 2, "selective", "bf16", micro_batch=8, dropout=0.1, sequence_parallel=True),
]


def pair_cases(pair: int) -> list[Case]:
    """The tp=1 cases rank pair `pair` (0: ranks 0-1, 1: ranks 2-3) runs: every other."""
    return [c for c in GRID + MIXED if c.tp == 1][pair::2]


def snapshot(tracker: MemTracker, kind: str) -> dict[str, int]:
    """Bytes on this rank's device by MemTracker's category, and "Total"."""
    (device_snapshot,) = tracker.get_tracker_snapshot(kind).values()
    return {getattr(key, "value", key): int(value) for key, value in device_snapshot.items()}


def instrument_step(topology: Topology, case: Case) -> dict[str, Any]:
    """Build the model and engine under a MemTracker, then run one optimizer step of
    `case.micro_batches` micro-batches under it: the peak by category, the bytes held
    once built and after the last backward, and `Engine.model_state_bytes()`."""
    tracker = MemTracker()
    parallel = TensorParallel.from_topology(topology, SEED, case.sequence_parallel)
    config = model_config(case)
    engine_config = EngineConfig(
        zero_stage=case.stage, precision=case.precision, micro_batches=case.micro_batches
    )
    with tracker:
        model = GPT(config, parallel, RecomputePolicy(Recompute(case.recompute)), seed=SEED)
        engine = Engine(model, topology, parallel, engine_config, units=list(model.blocks))
    tracker.track_external(model, engine.optimizer)
    built = snapshot(tracker, "current")
    g = torch.Generator().manual_seed(topology.dp_rank)
    shape = (case.micro_batches, case.micro_batch, config.seq_len + 1)
    ids = torch.randint(0, MODEL.vocab_size, shape, generator=g)
    with tracker:  # entering resets the peak to what is held now
        for micro in ids:
            tracker.reset_mod_stats()  # MemTracker follows one pass of a module per reset
            engine.backward(engine(micro[:, :-1], micro[:, 1:]))
        after_backward = snapshot(tracker, "current")
        engine.step(LR)
    return {
        "case": dataclasses.asdict(case),
        "dp": topology.dp,
        "built": built,
        "after_backward": after_backward,
        "peak": snapshot(tracker, "peak"),
        "engine": engine.model_state_bytes(),
    }


def measure_all() -> list[dict[str, Any]]:
    """On each of 4 ranks: the tp=2 cases on the whole job (dp 2), then this rank pair's
    tp=1 cases (dp 2). Rank 0 reports the tp=2 cases and its pair's, rank 2 its pair's."""
    env = init_distributed()
    try:
        rank = dist.get_rank()
        whole, ones = Topology.build(2), pair_topologies()[1]
        with warnings.catch_warnings():
            # MemTracker's gradient hook also fires for parameters whose gradient the
            # engine has already moved into its buckets (param.grad is None then).
            warnings.filterwarnings("ignore", message="Expected a tensor")
            twos = [instrument_step(whole, c) for c in GRID + MIXED if c.tp == 2]
            mine = [instrument_step(ones, c) for c in pair_cases(rank // 2)]
        return {0: twos + mine, 2: mine}.get(rank, [])
    finally:
        shutdown(env)
