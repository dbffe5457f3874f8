"""Worker and reference for tests/precision/test_bf16_masters.py: bf16 training keeps fp32 master
weights, at dp 2 (ZeRO stages 1 and 2) and tp 2 x dp 2 (stage 3).

The learning rate is chosen so that the master weights are the only place an update can
live: Adam moves each weight by about LR a step, and LR = 1e-5 is below half a bf16 unit
in the last place of every weight with |w| >= 2^-8 (there the spacing is 2^-15 = 3.1e-5),
which is most of them (N(0, 0.02) weights, norm gains at 1.0). Weights kept in bf16
alone would round each of those updates away and stay put; fp32 masters accumulate them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from plan_cases import pair_topologies

from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel, parameter_shards
from hybrid.tensor_parallel.shards import gather_full
from models.gpt import GPT, GPTConfig

SEED = 21
STEPS = 4
GLOBAL_BATCH = 8
MICRO_BATCHES = 2  # per rank and step
CONFIG = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=16, vocab_size=256)
LR, WEIGHT_DECAY, BETAS = 1e-5, 0.1, (0.9, 0.95)


@dataclass(frozen=True)
class Layout:
    tp: int
    stage: int


# Rank pair 0 (ranks 0-1) and pair 1 (ranks 2-3) of the 4-rank job each run one dp=2 job;
# then all four ranks run tp 2 x dp 2.
PAIR_LAYOUTS = [Layout(1, 1), Layout(1, 2)]
WHOLE_LAYOUT = Layout(2, 3)


def global_batches() -> list[torch.Tensor]:
    """Counting sequences from random starts, one global batch per step."""
    g = torch.Generator().manual_seed(17)
    steps = torch.arange(CONFIG.seq_len + 1)
    return [
        (torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g) + steps)
        % CONFIG.vocab_size
        for _ in range(STEPS)
    ]


def reference(masters: bool = True) -> dict[str, Any]:
    """One process, written here from torch alone: forward and backward on a bf16 copy of
    fp32 master weights, each sequence's bf16 gradient taken to fp32 and averaged there,
    torch.optim.AdamW on the fp32 masters, the masters cast to bf16 again for the next
    step. `masters=False` is the implementation this test must reject: the same, but the
    weights are bf16 only (each update is rounded to bf16 before the next step).
    Returns the initial and per-step fp32 weights and the per-step mean losses."""
    master = GPT(CONFIG, seed=SEED)
    working = GPT(CONFIG, seed=SEED).to(torch.bfloat16)
    with torch.no_grad():  # masters start from the bf16 model (Megatron, DeepSpeed, ours)
        for p in master.parameters():
            p.copy_(p.to(torch.bfloat16))
    decay = [p for p in master.parameters() if p.dim() >= 2]
    other = [p for p in master.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, weight_decay=0.0)
    initial = {n: p.detach().clone() for n, p in master.named_parameters()}
    weights, losses = [], []
    for batch in global_batches():
        with torch.no_grad():
            for p, q in zip(working.parameters(), master.parameters(), strict=True):
                p.copy_(q)  # fp32 -> bf16, round to nearest
        grads = [torch.zeros_like(p) for p in master.parameters()]
        total = 0.0
        for sequence in batch.split(1):
            loss = working(sequence[:, :-1], sequence[:, 1:])
            loss.backward()
            total += loss.item() / GLOBAL_BATCH
            for grad, p in zip(grads, working.parameters(), strict=True):
                grad += p.grad.float() / GLOBAL_BATCH
            working.zero_grad(set_to_none=True)
        for p, grad in zip(master.parameters(), grads, strict=True):
            p.grad = grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not masters:
            with torch.no_grad():
                for p in master.parameters():
                    p.copy_(p.to(torch.bfloat16))
        weights.append({n: p.detach().clone() for n, p in master.named_parameters()})
        losses.append(total)
    return {"initial": initial, "weights": weights, "losses": losses}


def full_masters(engine: Engine) -> dict[str, torch.Tensor]:
    """The engine's fp32 master weights in tp=1 shapes, read from its bucket states (not
    from the bf16 parameters): each DP shard put in place and summed over DP (stages
    1-3), then each TP-split parameter gathered over TP. Every rank must call it."""
    specs = parameter_shards(engine.module)
    out = {}
    for bucket, state in zip(engine.buckets, engine.states, strict=True):
        assert state.master.dtype == torch.float32
        if engine.stage == 0:
            flat = state.master
        else:
            flat = state.master.new_zeros(bucket.numel)
            flat[bucket.shard_start : bucket.shard_start + bucket.shard_numel] = state.master
            engine.dp.all_reduce(flat)
        for i, name in enumerate(bucket.names):
            out[name] = gather_full(bucket.view(flat, i), specs.get(name), engine.tp.group).clone()
    return out


def run_layout(topology: Topology, layout: Layout) -> dict[str, Any]:
    """STEPS bf16 steps: per step the mean loss, the fp32 masters (tp=1 shapes) and
    whether the bf16 parameters are exactly the masters cast to bf16, on this rank's shard
    and on the full gathered model."""
    parallel = TensorParallel.from_topology(topology, SEED)
    model = GPT(CONFIG, parallel, seed=SEED)
    config = EngineConfig(
        zero_stage=layout.stage,
        precision="bf16",
        micro_batches=MICRO_BATCHES,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
    )
    engine = Engine(model, topology, parallel, config, units=list(model.blocks))
    per_rank = GLOBAL_BATCH // topology.dp
    initial = full_masters(engine)
    losses, masters, recast = [], [], []
    for batch in global_batches():
        mine = batch[topology.dp_rank * per_rank : (topology.dp_rank + 1) * per_rank]
        total = torch.zeros(())
        for micro in mine.chunk(MICRO_BATCHES):
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            total += loss.detach().float() / MICRO_BATCHES
        stats = engine.step(LR)
        assert not stats.skipped
        losses.append(float(topology.dp_group.all_reduce(total) / topology.dp))
        full = full_masters(engine)
        params = engine.full_state_dict()
        shards_equal = all(
            torch.equal(s.param_shard, s.master.to(torch.bfloat16)) for s in engine.states
        )
        full_equal = all(torch.equal(params[n], full[n].to(torch.bfloat16)) for n in full)
        dtypes = {str(t.dtype) for t in params.values()}
        masters.append(full)
        recast.append({"shards": shards_equal, "full": full_equal, "dtypes": sorted(dtypes)})
    return {
        "layout": vars(layout),
        "initial": initial,
        "losses": losses,
        "masters": masters,
        "recast": recast,
    }


def all_layouts() -> dict[str, Any]:
    """On each of 4 ranks: this pair's dp=2 layout, then tp 2 x dp 2. Ranks 0 and 2 report
    their pair's run, rank 0 also the whole job's; every rank reports its recast checks."""
    env = init_distributed()
    try:
        rank = dist.get_rank()
        pair = pair_topologies()[1]
        runs = [run_layout(pair, PAIR_LAYOUTS[rank // 2])]
        runs.append(run_layout(Topology.build(WHOLE_LAYOUT.tp), WHOLE_LAYOUT))
        for run in runs:
            if rank % 2 or (run["layout"] == vars(WHOLE_LAYOUT) and rank):
                run["initial"], run["masters"] = {}, []  # as its peers': a small queue
        return {"rank": rank, "runs": runs}
    finally:
        shutdown(env)
