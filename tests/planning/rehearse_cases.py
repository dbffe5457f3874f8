"""Worker functions for tests/planning/test_rehearse.py: the rehearsal's measurement on a real
4-process gloo job of the same layout, so what one faked rank holds can be compared with
what that rank of a real job holds."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from launch.config import Config, load_config, preset_path
from launch.planning.rehearsal import measure

WORLD = 4
# The tiny preset at tp 2 (dp 2), made uneven: 3 layers of d_model 120 (60 a TP rank)
# and a vocabulary of 500 real tokens padded to 512, in bf16 (fp32 masters apart).
OVERRIDES = [
    "parallel.tp=2",
    "model.n_layer=3",
    "model.d_model=120",
    "model.seq_len=64",
    "data.bpe_vocab_size=500",
    "train.precision=bf16",
    "train.micro_batch_size=4",
    "train.global_batch_size=16",  # 2 micro-batches per step
]
STAGES = (0, 1, 2, 3)


def config(stage: int, extra: tuple[str, ...] = ()) -> Config:
    return load_config(preset_path("tiny"), [*OVERRIDES, f"parallel.zero_stage={stage}", *extra])


def real_job() -> list[dict[str, Any]]:
    """On each of 4 gloo ranks: the rehearsal's measurement at every stage; returns this
    rank's results."""
    env = init_distributed()
    try:
        results = []
        for stage in STAGES:
            c = config(stage)
            topology = Topology.build(c.parallel.tp)
            results.append(measure(c, topology, env.device, steps=1))
            dist.barrier()
        return results
    finally:
        shutdown(env)
