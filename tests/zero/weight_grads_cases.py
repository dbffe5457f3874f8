"""What tests/zero/test_weight_grads.py runs: the model, its micro-batches, the engine, the
gradients the optimizer steps on, and a 2-rank worker (tp 2, sequence parallelism,
recomputation), where the column-parallel Linears' backward is
hybrid.tensor_parallel.layers._GatherSequenceLinear rather than hybrid.tensor_parallel.linear."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel, sync_sequence_parallel_grads
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=64)
LINEAR_WEIGHTS = {"attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"}


def micro_batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (2, CONFIG.seq_len + 1)
    return [torch.randint(0, CONFIG.vocab_size, shape, generator=g) for _ in range(count)]


def engine_of(
    model: nn.Module, topology: Topology, parallel: TensorParallel, stage: int, micro: int
) -> Engine:
    config = EngineConfig(zero_stage=stage, micro_batches=micro)
    units = list(getattr(model, "blocks", []))
    return Engine(model, topology, parallel, config, units=units)


def stepped_gradients(engine: Engine) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as the optimizer gets it (dp = 1: the shard is the whole
    flat range), read in a pre-step hook."""
    found: dict[str, torch.Tensor] = {}

    def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
        for bucket, state in zip(engine.buckets, engine.states, strict=True):
            flat = torch.cat([view.grad for _, view in state.master_segments])
            for i, name in enumerate(bucket.names):
                found[name] = bucket.view(flat, i).clone()

    engine.optimizer.register_step_pre_hook(capture)
    engine.step(1e-3)
    return found


def autograd_made_recorder(model: nn.Module) -> set[str]:
    """The names of the parameters autograd gave a gradient, filled as backward runs (the
    hooks are registered before the engine's, so they see what autograd gave)."""
    made: set[str] = set()
    names = {id(p): name for name, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda q: made.add(names[id(q)]) if q.grad is not None else None
        )
    return made


def sequence_parallel_sinks() -> dict[str, Any]:
    """tp 2 with sequence parallelism and full recomputation, stage 2, two micro-batches:
    this rank's autograd gradients (the reference, summed over TP where SP leaves partial
    sums), the engine's stepped ones, and the parameters autograd gave a gradient."""

    def work() -> dict[str, Any]:
        topology = Topology.build(tp=2)
        parallel = TensorParallel.from_topology(topology, 0, sequence_parallel=True)
        reference = GPT(CONFIG, parallel, seed=0)
        full = RecomputePolicy(Recompute.FULL)
        model = GPT(CONFIG, parallel, seed=0, recompute=full)
        batches = micro_batches(2)
        for ids in batches:
            (reference(ids[:, :-1], ids[:, 1:]) / len(batches)).backward()
        sync_sequence_parallel_grads(reference, parallel)
        made = autograd_made_recorder(model)
        engine = engine_of(model, topology, parallel, stage=2, micro=len(batches))
        for ids in batches:
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        return {
            "reference": {name: p.grad for name, p in reference.named_parameters()},
            "stepped": stepped_gradients(engine),
            "autograd_made": sorted(made),
        }

    return in_process_group(work)
