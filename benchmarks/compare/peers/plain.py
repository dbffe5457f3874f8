"""The references: the plain-PyTorch twin with torch AdamW and no wrapper, in one process
(the overhead reference), or on each DP rank with nothing synchronised (the floor: what
any DP system would take if communication and its bookkeeping were free)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ..common import JobSpec, adamw_groups, initial_state, make_adamw
from ..plain_gpt import from_state


class ModuleTrainer:
    """The optimizer side of a system that trains an `nn.Module` with torch AdamW: clip,
    step, zero; the module's parameters are what it holds. Subclasses set `model`,
    `optimizer` and `clip`, and may clip their own way (DTensor)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    clip: float

    def clip_gradients(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)

    def optimizer_step(self) -> None:
        if self.clip > 0:
            self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def tensor_roles(self) -> dict[str, list[torch.Tensor]]:
        # Gradients are the parameters' `.grad`, optimizer states torch's: found for all.
        return {"parameters": list(self.model.parameters())}

    def reported(self) -> dict[str, Any]:
        return {}


class PlainTrainer(ModuleTrainer):
    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        if spec.system == "plain" and spec.world != 1:
            raise ValueError("the plain loop runs in one process")
        if spec.tp != 1:
            raise ValueError("the floor is the plain loop on each DP rank: tp must be 1")
        bench = spec.bench
        self.model = from_state(bench.gpt_config(), initial_state(bench), spec.recompute)
        self.model.to(device)
        self.optimizer = make_adamw(
            adamw_groups(list(self.model.named_parameters()), bench.weight_decay), bench
        )
        self.clip = bench.grad_clip
        self.device_type, self.bf16 = device.type, bench.bf16
        # The floor: this rank trains on its own rows of the global batch and never meets
        # the others, so its losses and weights drift apart from the real run's.
        self.dp_rank = dist.get_rank() if spec.system == "floor" else 0
        self.tp_rank = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        autocast = (
            torch.autocast(self.device_type, torch.bfloat16)
            if self.bf16
            else contextlib.nullcontext()
        )
        with autocast:
            return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
