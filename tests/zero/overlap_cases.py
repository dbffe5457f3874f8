"""Worker functions for tests/zero/test_param_gather_overlap.py: ZeRO stages 1-2 at dp=2, fp32,
with each unit in a bucket of its own, trained with the parameter all-gather waited for in
forward pre-hooks (hybrid.zero.publish) or in the step."""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from tp_cases import in_process_group
from zero_cases import CLIP, GLOBAL_BATCH, LR, MICRO, SEED, WEIGHT_DECAY

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

STEPS = 3
# Layers of 3 MB: a gather takes longer over loopback than issuing it, so its span covers
# the forward products that follow (with 0.2 MB layers it could end within the call).
CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=32, vocab_size=128)
BUCKET_MB = 0.01  # below one layer: one bucket per unit, so later gathers can overlap


def global_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    shape = (GLOBAL_BATCH, CONFIG.seq_len + 1)
    return [torch.randint(0, CONFIG.vocab_size, shape, generator=g) for _ in range(STEPS + 1)]


# How torch's profiler names a gather in flight: gloo's own all-gather, or the receives of the
# pairwise exchange hybrid.distributed.comm uses on gloo (hybrid.distributed.pairwise; forward
# receives nothing else).
GATHER_EVENTS = ("gloo:all_gather", "gloo:recv")


def _overlapping(events: list[Any]) -> int:
    """Forward matrix products (aten::addmm, aten::mm) that start while a gather is in
    flight, by the profiler's clock (gloo:all_gather and gloo:recv span from the call to
    the work's end; recorded by torch, not by the code under test)."""
    gathers = [e.time_range for e in events if e.name in GATHER_EVENTS]
    products = [e.time_range.start for e in events if e.name in ("aten::addmm", "aten::mm")]
    return sum(any(g.start <= t <= g.end for g in gathers) for t in products)


def train(stage: int) -> dict[bool, dict[str, Any]]:
    """For overlap_param_gather True and False, in one process group (one after the
    other, from the same seed): per-step losses, an eval loss after the last step, the
    final full weights, and the forward products overlapping a gather in the forward
    after the first step."""

    def run(topology: Topology, overlap: bool) -> dict[str, Any]:
        tp = TensorParallel.from_topology(topology, SEED)
        model = GPT(CONFIG, tp, seed=SEED)
        config = EngineConfig(
            zero_stage=stage,
            micro_batches=GLOBAL_BATCH // MICRO // topology.dp_group.size,
            grad_clip=CLIP,
            weight_decay=WEIGHT_DECAY,
            bucket_mb=BUCKET_MB,
            overlap_param_gather=overlap,
        )
        engine = Engine(model, topology, tp, config, units=list(model.blocks))
        losses, overlapping = [], None
        for step, batch in enumerate(global_batches()[:STEPS]):
            mine = batch.chunk(topology.dp_group.size)[topology.dp_rank]
            total = 0.0
            for i, micro in enumerate(mine.split(MICRO)):
                if step == 1 and i == 0:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        loss = engine(micro[:, :-1], micro[:, 1:])
                    overlapping = _overlapping(prof.events())
                else:
                    loss = engine(micro[:, :-1], micro[:, 1:])
                engine.backward(loss)
                total += loss.item()
            engine.step(LR)
            losses.append(total)
        with torch.no_grad():
            probe = global_batches()[STEPS]
            evaluated = engine(probe[:, :-1], probe[:, 1:]).item()
        return {
            "losses": losses,
            "eval": evaluated,
            "weights": engine.full_state_dict(),
            "overlapping": overlapping,
            "buckets": len(engine.buckets),
        }

    def work() -> dict[bool, dict[str, Any]]:
        topology = Topology.build(1)
        return {overlap: run(topology, overlap) for overlap in (True, False)}

    return in_process_group(work)
