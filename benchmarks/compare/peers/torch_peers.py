"""PyTorch's own parallelism on the plain twin: DDP, FSDP2 (`fully_shard` per block, then
the root), DTensor tensor parallelism (`parallelize_module`, the loss under
`loss_parallel`) and FSDP2 over DTensor TP (2D), the way their documentation composes them.

TP plan (Megatron's, as ours): QKV and the MLP's first linear column-wise, the attention
output and the MLP's second linear row-wise, the token embedding split by vocabulary rows;
the tied output layer reuses that split (plain_gpt.PlainGPT.logits), so the logits stay
split by vocabulary into the loss. LayerNorms and the position embedding stay replicated.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from ..common import JobSpec, adamw_groups, initial_state, make_adamw
from ..plain_gpt import PlainGPT, from_state
from .plain import ModuleTrainer


def parallelize_tp(model: PlainGPT, mesh: DeviceMesh) -> None:
    parallelize_module(
        model,
        mesh,
        {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())},
    )
    for block in model.blocks:
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )


def shard_fsdp2(model: PlainGPT, mesh: DeviceMesh, bf16: bool) -> None:
    """One FSDP2 unit per block, then the root (embeddings, final norm)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if bf16 else {})}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


@torch.no_grad()
def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global L2 norm when parameters mix plain tensors and DTensors on
    different meshes (TP leaves norms replicated; FSDP2 + TP puts TP weights on the 2D
    mesh and the rest on the DP mesh), which torch's clip_grad_norm_ cannot stack. Each
    DTensor group's norm is reduced over its own mesh, so every element counts once."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    square = torch.zeros((), dtype=torch.float64)
    for key, grads in groups.items():
        part = torch.stack(torch._foreach_norm(grads)).square().sum()
        if key is not None:
            part = part.full_tensor()
        square += part.double().cpu()
    norm = float(square.sqrt())
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coefficient)
    return norm


class TorchTrainer(ModuleTrainer):
    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        bench = spec.bench
        self.system, self.bf16, self.device_type = spec.system, bench.bf16, device.type
        mesh = init_device_mesh(device.type, (spec.dp, spec.tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank, self.tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
        model = from_state(bench.gpt_config(), initial_state(bench), spec.recompute).to(device)
        self.module: nn.Module = model
        if spec.system == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            self.module = DistributedDataParallel(
                model, device_ids=ids, bucket_cap_mb=bench.bucket_mb
            )
        elif spec.system == "fsdp2":
            shard_fsdp2(model, mesh["dp"], self.bf16)
        elif spec.system == "dtensor_tp":
            parallelize_tp(model, mesh["tp"])
        elif spec.system == "fsdp2_tp":
            parallelize_tp(model, mesh["tp"])
            shard_fsdp2(model, mesh["dp"], self.bf16)
        else:
            raise ValueError(f"unknown torch system {spec.system!r}")
        self.model = model
        self.optimizer = make_adamw(
            adamw_groups(list(model.named_parameters()), bench.weight_decay), bench
        )
        self.clip = bench.grad_clip
        self.tensor_parallel = spec.tp > 1

    def _parallel_loss(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.tensor_parallel else contextlib.nullcontext()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # FSDP2 casts by its mixed-precision policy; the others autocast on GPU.
        autocast = (
            torch.autocast(self.device_type, torch.bfloat16)
            if self.bf16 and "fsdp2" not in self.system
            else contextlib.nullcontext()
        )
        with self._parallel_loss(), autocast:
            return self.module(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        with self._parallel_loss():
            loss.backward()

    def local_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.to_local() if isinstance(loss, DTensor) else loss  # replicated over TP

    def clip_gradients(self) -> None:
        if self.tensor_parallel:
            clip_grad_norm(list(self.model.parameters()), self.clip)
        else:
            super().clip_gradients()
