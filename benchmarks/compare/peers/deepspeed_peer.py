"""DeepSpeed ZeRO stage 0-3 on the plain twin, launched by torchrun over the existing
process group, with torch's AdamW as the client optimizer (so nothing is compiled but the
shared-memory communication op DeepSpeed builds on first use) and our bucket size as its
reduce and all-gather bucket sizes."""

from __future__ import annotations

from typing import Any

import deepspeed
import torch

from ..common import JobSpec, adamw_groups, initial_state, make_adamw
from ..plain_gpt import from_state

# DeepSpeed ZeRO optimizer attributes that hold gradient partitions, and fp32 masters.
GRADIENT_ATTRIBUTES = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")
MASTER_ATTRIBUTES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value, or in a list/tuple/dict of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _tensors_in(owner: Any, names: tuple[str, ...]) -> list[torch.Tensor]:
    return [t for name in names for t in _tensors(getattr(owner, name, None))]


def ds_config(spec: JobSpec) -> dict[str, Any]:
    bench = spec.bench
    bucket = bench.bucket_elements()
    zero: dict[str, Any] = {
        "stage": spec.stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    return {
        "train_batch_size": bench.global_batch,
        "train_micro_batch_size_per_gpu": bench.global_batch // spec.dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": bench.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bench.bf16},
        "steps_per_print": 2**30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        if spec.tp != 1:
            raise ValueError("the DeepSpeed peer runs ZeRO along DP only (tp=1)")
        bench = spec.bench
        model = from_state(bench.gpt_config(), initial_state(bench), spec.recompute).to(device)
        optimizer = make_adamw(
            adamw_groups(list(model.named_parameters()), bench.weight_decay), bench
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config(spec)
        )
        self.dp_rank, self.tp_rank = self.engine.global_rank, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step()

    def tensor_roles(self) -> dict[str, list[torch.Tensor]]:
        # At stage 3 a module parameter is an empty placeholder; its shard is ds_tensor.
        # DeepSpeed's ZeRO optimizer keeps gradient partitions and fp32 masters in its own
        # attributes (DeepSpeed 0.19: stages 1-2 in stage_1_and_2.py, 3 in stage3.py), and
        # preallocates reduce buckets (`ipg_buckets`: stage 3 at start-up, stages 1-2 for
        # each backward), which are communication buffers, not model states.
        params = list(self.engine.module.parameters())
        optimizer = self.engine.optimizer
        buckets = getattr(optimizer, "ipg_buckets", None) or {}
        masters = _tensors_in(optimizer, MASTER_ATTRIBUTES)
        return {
            "parameters": params
            + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None],
            "gradients": _tensors_in(optimizer, GRADIENT_ATTRIBUTES)
            + [m.grad for m in masters if m.grad is not None],
            "optimizer": masters,
            "buffers": [t for bucket in buckets.values() for t in _tensors(bucket.buffer)],
        }

    def reported(self) -> dict[str, Any]:
        return {"deepspeed": deepspeed.__version__}
