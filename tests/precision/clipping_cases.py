"""Worker and reference for tests/precision/test_clipping.py: gradient clipping at every ZeRO stage
and TP layout against `torch.nn.utils.clip_grad_norm_` on one process.

Why Adam's eps is large here: Adam divides the update by the gradient's own scale, so a
clip (one factor on the whole gradient) changes the first update only through eps, and
later ones through the ratio of successive factors. With torch's default eps (1e-8) an
unclipped first step lands a median 1e-6 from the clipped one (the weight tolerance),
and the elements where it differs most are those with near-zero gradients, whose
sign-like Adam update also flips on rounding noise between layouts. With eps 1e-3, above
the clipped gradient's typical element (0.1 over the square root of 117k parameters:
about 3e-4), each update is nearly proportional to the clipped gradient: an unclipped or
wrongly clipped step misses in almost every weight (median 5e-3 after one step), while
rounding noise stays at 1e-7. The test checks the first half of that on the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

SEED = 5
STEPS = 3
GLOBAL_BATCH = 8
MICRO_BATCHES = 2  # per rank and step: accumulation at every layout
CONFIG = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=16, vocab_size=256)
LR, WEIGHT_DECAY, EPS = 1e-2, 0.1, 1e-3
CLIP = 0.1  # below the gradient norm of every checked step (the test asserts it)
BETAS = (0.9, 0.95)
# 0.1 MB: one bucket per unit at stages 0-2 too (a unit is 0.2 MB at tp 1, 0.1 MB at tp 2),
# so the norm sums over several buckets' shards.
BUCKET_MB = 0.1


@dataclass(frozen=True)
class Layout:
    tp: int
    stage: int
    sequence_parallel: bool = False


# One 4-rank job: tp 1 x dp 4 at every stage, then tp 2 x dp 2 at every stage with and
# without sequence parallelism (which needs tp > 1).
LAYOUTS = [Layout(1, stage) for stage in range(4)] + [
    Layout(2, stage, sp) for stage in range(4) for sp in (False, True)
]


def global_batches() -> list[torch.Tensor]:
    """Counting sequences from random starts, one global batch per step."""
    g = torch.Generator().manual_seed(13)
    steps = torch.arange(CONFIG.seq_len + 1)
    return [
        (torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g) + steps)
        % CONFIG.vocab_size
        for _ in range(STEPS)
    ]


def reference(clip: bool = True) -> dict[str, list[Any]]:
    """One process, tp 1, dp 1: torch.optim.AdamW after torch's clip_grad_norm_ (or, with
    `clip=False`, with no clipping, to show the clip changes the weights). Returns, per
    step, the pre-clip norm torch reports and the weights after the step."""
    model = GPT(CONFIG, seed=SEED)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    norms, weights = [], []
    micro_total = MICRO_BATCHES * 4  # the most ranks any layout has: same micro-batches
    for batch in global_batches():
        for micro in batch.chunk(micro_total):
            (model(micro[:, :-1], micro[:, 1:]) / micro_total).backward()
        max_norm = CLIP if clip else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"norms": norms, "weights": weights}


def run_layout(topology: Topology, layout: Layout) -> dict[str, Any]:
    """STEPS clipped steps at one layout: every step's reported norm and skip flag, and
    the full (tp=1) weights after each step."""
    parallel = TensorParallel.from_topology(topology, SEED, layout.sequence_parallel)
    model = GPT(CONFIG, parallel, seed=SEED)
    config = EngineConfig(
        zero_stage=layout.stage,
        micro_batches=MICRO_BATCHES,
        grad_clip=CLIP,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
        eps=EPS,
        bucket_mb=BUCKET_MB,
    )
    engine = Engine(model, topology, parallel, config, units=list(model.blocks))
    per_rank = GLOBAL_BATCH // topology.dp
    norms, skipped, weights = [], [], []
    for batch in global_batches():
        mine = batch[topology.dp_rank * per_rank : (topology.dp_rank + 1) * per_rank]
        for micro in mine.chunk(MICRO_BATCHES):
            engine.backward(engine(micro[:, :-1], micro[:, 1:]))
        stats = engine.step(LR)
        norms.append(stats.grad_norm)
        skipped.append(stats.skipped)
        full = engine.full_state_dict()  # every rank takes part; rank 0 reports them
        weights.append(full if topology.rank == 0 else {})
    return {
        "layout": layout,
        "norms": norms,
        "skipped": skipped,
        "weights": weights,
    }


def all_layouts() -> list[dict[str, Any]]:
    """On each of 4 ranks: every layout of LAYOUTS, in order, in one process group."""

    def work() -> list[dict[str, Any]]:
        topologies = {tp: Topology.build(tp) for tp in (1, 2)}
        results = []
        for layout in LAYOUTS:
            result = run_layout(topologies[layout.tp], layout)
            result["layout"] = vars(layout)  # plain types through run_processes' queue
            results.append(result)
        return results

    return in_process_group(work)
