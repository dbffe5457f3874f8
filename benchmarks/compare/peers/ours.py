"""Our engine: the GPT on hybrid layers at tp, ZeRO stage 0-3 along dp."""

from __future__ import annotations

from typing import Any

import torch

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT

from ..common import SEED, JobSpec, initial_state


class OursTrainer:
    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        bench = spec.bench
        self.topology = Topology.build(spec.tp, device.type)
        if self.topology.dp != spec.dp:
            raise ValueError(
                f"world {self.topology.world_size} at tp={spec.tp} is not dp={spec.dp}"
            )
        tp = TensorParallel.from_topology(self.topology, SEED, device=device)
        policy = RecomputePolicy(Recompute.FULL if spec.recompute else Recompute.NONE)
        weights = None if bench.ours_draws_weights else initial_state(bench)
        model = GPT(bench.gpt_config(), tp, policy, seed=SEED, device=device, init_weights=weights)
        config = EngineConfig(
            zero_stage=spec.stage,
            precision="bf16" if bench.bf16 else "fp32",
            grad_clip=bench.grad_clip,
            weight_decay=bench.weight_decay,
            betas=bench.betas,
            eps=bench.eps,
            bucket_mb=bench.bucket_mb,
        )
        self.engine = Engine(model, self.topology, tp, config, list(model.blocks), device)
        self.lr = bench.lr
        self.dp_rank, self.tp_rank = self.topology.dp_rank, self.topology.tp_rank
        self.steps = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step(self.lr)
        self.steps += 1

    def tensor_roles(self) -> dict[str, list[torch.Tensor]]:
        # Parameters are views into the buckets' flat storages (stage 3: the shards);
        # gradients are the flat full buffers (stage 0), the reduced shards, or autograd's
        # own (stage 0 at dp=1); in fp32 the master is the parameter shard itself (counted
        # once, as a parameter).
        states, params = self.engine.states, list(self.engine.module.parameters())
        return {
            "parameters": [s.param_storage for s in states] + params,
            "gradients": [t for s in states for t in (s.grad_flat, s.grad_shard) if t is not None]
            + [p.grad for p in params if p.grad is not None],
            "optimizer": [
                t for s in states for t in (s.master, s.exp_avg, s.exp_avg_sq) if t is not None
            ],
        }

    def reported(self) -> dict[str, Any]:
        # hybrid.distributed.comm's own count, per step (every step moves the same): a
        # cross-check of the dispatcher-level count that all systems get.
        per_step = {
            f"{kind}/{group}": nbytes // max(self.steps, 1)
            for (kind, group), nbytes in self.topology.counter.bytes.items()
        }
        return {"model_state_bytes": self.engine.model_state_bytes(), "comm_bytes": per_step}
