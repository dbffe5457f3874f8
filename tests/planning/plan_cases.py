"""Worker functions for the planner tests: what the engine and the model really hold and
send, at one layout, to compare with launch.plan's predictions."""

from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stdout
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.memory.activation_memory import Case, build, saved_bytes
from hybrid.distributed.comm import CollectiveCounter, Group
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.memory import activation_bytes
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from launch.plan import main
from models.gpt import GPT, GPTConfig
from models.gpt.accounting import transformer_shape

# Three small models: GPT-2 style, with dropout, a vocabulary that does not divide by tp
# (local padding) and layers of odd size per TP rank at tp 2 (bucket padding at dp 2);
# Llama style (RMSNorm, SwiGLU, rotary, grouped-query, untied, no biases); one in fp32
# (the master weights are the parameters: K = 8) with odd sizes (padding at dp 2 and 4),
# whose 3 heads keep it at tp 1.
MODELS = {
    "gpt2": (
        GPTConfig(n_layer=3, n_head=6, d_model=66, seq_len=8, vocab_size=1001, dropout=0.1),
        "bf16",
    ),
    "llama": (
        GPTConfig(
            n_layer=3,
            n_head=4,
            d_model=48,
            seq_len=8,
            vocab_size=1001,
            norm="rmsnorm",
            mlp="swiglu",
            d_ff=72,
            positions="rope",
            n_kv_head=2,
            tie_embeddings=False,
            bias=False,
        ),
        "bf16",
    ),
    "fp32": (GPTConfig(n_layer=2, n_head=3, d_model=45, seq_len=8, vocab_size=515), "fp32"),
}
# About two GPT-2 layers per bucket at stages 0-2, so the grouping rule matters.
BUCKET_MB = 0.12
MICRO_BATCH, MICRO_BATCHES = 1, 2
# Activations: the measured model (dropout on, as the paper counts, and off: fused kernel).
ACTIVATION_MODEL = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=1001)
ACTIVATION_BATCH = 2


def engine_layouts(world_size: int) -> list[dict[str, Any]]:
    """(model, tp, sequence parallel, recompute, ZeRO stages) that a world of this size
    runs: every model at every stage with TP 1 (dp = world size) and TP 2 (the rest);
    sequence parallelism and recomputation, which change only TP traffic and activations,
    at the extreme stages."""
    every, ends = (0, 1, 2, 3), (0, 3)
    layouts = [(m, 1, False, "none", every) for m in MODELS]
    if world_size == 2:
        layouts += [(m, 2, False, "none", every) for m in ("gpt2", "llama")]
        layouts += [
            ("gpt2", 2, False, "full", ends),  # dropout: the recomputed forward repeats all
            ("llama", 2, True, "full", ends),  # no dropout: it stops before the last one
            ("llama", 2, True, "selective", ends),
        ]
    if world_size == 4:
        layouts += [("gpt2", 2, False, "none", every), ("gpt2", 2, True, "full", ends)]
    return [
        {"model": m, "tp": tp, "sp": sp, "recompute": mode, "stage": stage}
        for m, tp, sp, mode, stages in layouts
        for stage in stages
    ]


def _moved(topology: Topology, group: str) -> float:
    """Bytes this rank sent over `group` by the ring rule (hybrid.distributed.comm counts full
    sizes)."""
    n = topology.tp if group == "tp" else topology.dp
    return sum(
        nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)
        for (kind, name), nbytes in topology.counter.bytes.items()
        if name == group
    )


def pair_topologies() -> dict[int, Topology]:
    """Ranks (0, 1) and (2, 3) of a 4-rank job as two independent 2-rank jobs, at tp 1
    (dp 2) and tp 2 (dp 1): one spawn then serves every world size. Every rank creates
    every group (torch.distributed requires it), in the same order."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, rank = pairs[dist.get_rank() // 2], dist.get_rank() % 2
    topologies = {}
    for tp in (1, 2):
        counter = CollectiveCounter()
        tp_group = Group("tp", mine if tp == 2 else None, counter)
        dp_group = Group("dp", mine if tp == 1 else None, counter)
        topologies[tp] = Topology(
            2, tp, 2 // tp, rank, rank % tp, rank // tp, tp_group, dp_group, counter, None
        )
    return topologies


def engine_step(
    topology: Topology, name: str, tp: int, sp: bool, recompute: str, stage: int
) -> dict[str, Any]:
    """One optimizer step of MICRO_BATCHES micro-batches; the engine's accounting and the
    bytes sent over DP and TP."""
    config, precision = MODELS[name]
    parallel = TensorParallel.from_topology(topology, 0, sp)
    model = GPT(config, parallel, RecomputePolicy(Recompute(recompute)), seed=0)
    engine = Engine(
        model,
        topology,
        parallel,
        EngineConfig(
            zero_stage=stage,
            precision=precision,
            micro_batches=MICRO_BATCHES,
            bucket_mb=BUCKET_MB,
        ),
        units=list(model.blocks),
    )
    g = torch.Generator().manual_seed(topology.dp_rank)
    topology.counter.reset()
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, config.vocab_size, (MICRO_BATCH, config.seq_len + 1), generator=g)
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step(1e-4)
    engine.wait_for_parameters()  # the step's all-gather, issued in part by the next forward
    return {
        "model": name,
        "tp": tp,
        "dp": topology.dp,
        "sp": sp,
        "recompute": recompute,
        "stage": stage,
        "bytes": engine.model_state_bytes(),
        "padding": sum(b.padding for b in engine.buckets),
        "dp_moved": _moved(topology, "dp"),
        "tp_moved": _moved(topology, "tp"),
    }


def activation_cases(tp: int) -> list[Case]:
    modes = ("none", "selective", "full")
    if tp == 1:
        return [Case(mode, 1, False) for mode in modes]
    return [Case(mode, tp, sp) for mode in modes for sp in (False, True)]


def activations(topology: Topology) -> list[dict[str, Any]]:
    """Saved bytes by part for every recompute mode (and SP at tp > 1), dropout 0.1 and 0."""
    results = []
    for dropout in (0.1, 0.0):
        config = dataclasses.replace(ACTIVATION_MODEL, dropout=dropout)
        for case in activation_cases(topology.tp):
            torch.manual_seed(0)
            ids = torch.randint(0, config.vocab_size, (ACTIVATION_BATCH, config.seq_len + 1))
            measured = saved_bytes(build(case, config, topology), ids)
            results.append({"case": dataclasses.asdict(case), "dropout": dropout, **measured})
    return results


def predicted_activations(measured: dict[str, Any]) -> dict[str, float]:
    """The planner's activation bytes by part for one measured case of `activations`."""
    case = measured["case"]
    config = dataclasses.replace(ACTIVATION_MODEL, dropout=measured["dropout"])
    return activation_bytes(
        transformer_shape(config),
        ACTIVATION_BATCH,
        case["tp"],
        case["sequence_parallel"],
        case["recompute"],
        element=2,
    )


def measure_all() -> dict[str, list[dict[str, Any]]]:
    """On each of 4 ranks: every engine layout of engine_layouts(1, 2 and 4) and the
    activations at tp 1 and 2 (rank 0's results are the ones compared)."""
    env = init_distributed()
    try:
        pairs = pair_topologies()
        topologies = {
            1: {1: Topology.single()},
            2: pairs,
            4: {tp: Topology.build(tp) for tp in (1, 2)},
        }
        steps = [
            engine_step(
                topologies[world][x["tp"]], x["model"], x["tp"], x["sp"], x["recompute"], x["stage"]
            )
            for world in (1, 2, 4)
            for x in engine_layouts(world)
        ]
        measured = activations(topologies[1][1]) + activations(pairs[2])
        return {"steps": steps, "activations": measured}
    finally:
        shutdown(env)


def run_plan(args: list[str]) -> dict:
    """`launch.plan ARGS --json`, run in this process; its report."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*args, "--json"]) == 0
    return json.loads(out.getvalue())
