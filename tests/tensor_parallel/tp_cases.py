"""Worker functions for the tensor-parallel tests; each runs inside every spawned rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel, named_full_tensors, sync_sequence_parallel_grads
from models.gpt import GPT, GPTConfig

SEED = 11


def in_process_group(work: Callable[[], Any]) -> Any:
    env = init_distributed()
    try:
        return work()
    finally:
        shutdown(env)


def batch(config: GPTConfig, size: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (size, config.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def forward_backward(model: GPT, config: GPTConfig) -> dict[str, Any]:
    """Full logits, loss and every gradient gathered across TP (the tp=1 shapes)."""
    x, y = batch(config)
    with torch.no_grad():
        logits = model(x)
    loss = model(x, y)
    loss.backward()
    sync_sequence_parallel_grads(model, model.tp)
    grads = dict(named_full_tensors(model, model.tp.group, grads=True))
    return {"logits": logits, "loss": loss.item(), "grads": grads}


def build(
    config: GPTConfig,
    topology: Topology,
    sequence_parallel: bool = False,
    recompute: RecomputePolicy | None = None,
) -> GPT:
    torch.manual_seed(SEED + 1)  # the default stream, for dropout in replicated regions
    tp = TensorParallel.from_topology(topology, SEED, sequence_parallel)
    return GPT(config, tp, recompute, seed=SEED)


def reference(config: GPTConfig) -> dict[str, Any]:
    return forward_backward(build(config, Topology.single()), config)


def equivalence(tp: int, config: GPTConfig) -> dict[bool, dict[str, Any]]:
    """Results at tensor-parallel degree `tp`, without and with sequence parallelism."""

    def work() -> dict[bool, dict[str, Any]]:
        topology = Topology.build(tp)
        return {sp: forward_backward(build(config, topology, sp), config) for sp in (False, True)}

    return in_process_group(work)


def recompute_grads(tp: int, cases: list[tuple[GPTConfig, bool]]) -> list[dict[str, Any]]:
    """Gradients (dropout on) for each recompute policy, for each (config, sequence
    parallel) case: one process group for all of them."""

    def work() -> list[dict[str, Any]]:
        topology = Topology.build(tp)
        policies = {
            "none": RecomputePolicy(),
            "selective": RecomputePolicy(Recompute.SELECTIVE),
            "full": RecomputePolicy(Recompute.FULL),
            "full-every-2": RecomputePolicy(Recompute.FULL, every=2),
        }
        return [
            {
                name: forward_backward(build(config, topology, sp, policy), config)
                for name, policy in policies.items()
            }
            for config, sp in cases
        ]

    return in_process_group(work)


def collective_counts(
    tp: int, configs: list[GPTConfig], sequence_parallel: bool
) -> list[dict[str, Any]]:
    """Counted TP collectives of one forward and one backward, by kind, for each config."""

    def work() -> list[dict[str, Any]]:
        topology = Topology.build(tp)
        counts = []
        for config in configs:
            model = build(config, topology, sequence_parallel)
            x, y = batch(config)
            counter = topology.counter
            counter.reset()
            loss = model(x, y)
            forward = counter.snapshot()
            counter.reset()
            loss.backward()
            counts.append({"forward": forward, "backward": counter.snapshot()})
        return counts

    return in_process_group(work)


def rng_streams(tp: int) -> list[torch.Tensor]:
    """Every rank's draw from the TP stream and from the default stream (all ranks alike)."""

    def work() -> list[torch.Tensor]:
        topology = Topology.build(tp)
        torch.manual_seed(SEED + 1)
        parallel = TensorParallel.from_topology(topology, SEED)
        with parallel.split_region_rng():
            split = torch.rand(4)
        replicated = torch.rand(4)
        with parallel.split_region_rng():
            split_again = torch.rand(4)  # the TP stream advances; it does not restart
        mine = torch.stack([split, replicated, split_again])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return everyone

    return in_process_group(work)


def mapping_ops() -> dict[str, torch.Tensor]:
    """Forward values and input gradients of each conjugate operator on 2 ranks."""
    from hybrid.tensor_parallel import mappings as m

    def work() -> dict[str, torch.Tensor]:
        topology = Topology.build(dist.get_world_size())
        group, rank = topology.tp_group, topology.tp_rank
        out = {}
        ops = {
            "copy": m.copy_to_region,
            "reduce": m.reduce_from_region,
            "gather_region": m.gather_from_region,
            "scatter_seq": m.scatter_to_sequence,
            "gather_seq": m.gather_from_sequence,
            "reduce_scatter_seq": m.reduce_scatter_to_sequence,
        }
        for name, op in ops.items():
            x = (torch.arange(8.0).reshape(4, 2) + 10 * rank).requires_grad_()
            y = op(x, group)
            weight = torch.arange(float(y.numel())).reshape(y.shape) + 100 * rank
            (y * weight).sum().backward()
            out[f"{name}.y"], out[f"{name}.grad"] = y.detach(), x.grad
        return out

    return in_process_group(work)
