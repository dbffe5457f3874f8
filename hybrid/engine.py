"""Engine: a model built from hybrid layers, trained with ZeRO stage 0-3 along DP.

    engine = Engine(model, topology, tp, EngineConfig(zero_stage=2, micro_batches=2), units)
    for x, y in micro_batches:
        engine.backward(engine(x, y))
    stats = engine.step(lr)

ZeRO (Rajbhandari et al. 2020, section 5; DESIGN.md section 2), per DP group of one TP rank:
- stage 0: everything replicated; gradients all-reduced once per step;
- stage 1: fp32 master weights and Adam moments only for this rank's 1/dp shard; gradients
  reduce-scattered, the optimizer steps on the shard, updated parameters all-gathered;
- stage 2: gradients kept only as shards: each bucket is reduce-scattered from gradient
  hooks during backward and its full gradients released at once;
- stage 3: parameters kept only as shards: a unit's parameters are all-gathered just before
  its forward and again before its backward, and freed after each.
Buckets are the `units` (e.g. transformer layers) plus one for the remaining parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel import TensorParallel, named_full_tensors, parameter_shards
from .topology import Topology
from .zero.bucket import Bucket

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    zero_stage: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (dynamic loss scaling)
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    grad_clip: float = 0.0  # max global gradient norm; 0 = off
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000  # good fp16 steps before the scale doubles


@dataclass
class StepStats:
    grad_norm: float
    skipped: bool
    loss_scale: float


class Engine:
    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        tp: TensorParallel,
        config: EngineConfig,
        units: list[nn.Module] | None = None,
    ) -> None:
        if config.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={config.zero_stage} must be 0, 1, 2 or 3")
        self.module, self.topology, self.tp, self.config = model, topology, tp, config
        self.dtype = DTYPES[config.precision]
        self.dp = topology.dp_group
        model.to(self.dtype)
        self.loss_scale = config.initial_loss_scale if config.precision == "fp16" else 1.0
        self._good_steps = 0
        self._micro_step = 0
        split = set(parameter_shards(model))
        self._split_ids = {id(p) for name, p in model.named_parameters() if name in split}

        units = units or []
        in_units = {id(p) for unit in units for p in unit.parameters()}
        groups = [[p for p in model.parameters() if id(p) not in in_units]]
        groups += [list(unit.parameters()) for unit in units]
        sharded = config.zero_stage >= 1
        dp_size, dp_rank = (self.dp.size, self.dp.rank) if sharded else (1, 0)
        self.buckets = [Bucket(g, dp_size, dp_rank) for g in groups if g]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._ready = {id(b): 0 for b in self.buckets}
        self._grad_shards: dict[int, torch.Tensor] = {}

        self.masters: list[tuple[Any, Bucket, torch.Tensor]] = []
        decay, no_decay = [], []
        for bucket in self.buckets:
            for piece in bucket.pieces:
                flat = piece.param.detach().reshape(-1)[piece.start : piece.end]
                master = flat.float().clone().requires_grad_()
                self.masters.append((piece, bucket, master))
                (decay if piece.param.dim() >= 2 else no_decay).append(master)
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=0.0,
            betas=config.betas,
            eps=config.eps,
        )
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)

        self._shard_data: dict[int, torch.Tensor] = {}
        self._gathered: set[int] = set()
        if config.zero_stage == 3:
            for bucket in self.buckets:
                full = bucket.flatten([p.detach() for p in bucket.params])
                self._shard_data[id(bucket)] = self._my_shard(full, bucket).clone()
                self._free(bucket)
            model.register_forward_pre_hook(lambda m, a: self._gather(self.buckets[0]))
            for unit, bucket in zip(units, self.buckets[1:], strict=True):
                unit.register_forward_pre_hook(lambda m, a, b=bucket: self._gather(b))
                unit.register_forward_hook(lambda m, a, out, b=bucket: self._after_forward(b, out))

    # ---- forward and backward -------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (scaled by 1/micro_batches and, for fp16,
        the loss scale). Gradient reduction runs from hooks: every micro-batch at stages 2-3,
        the last one only at stages 0-1."""
        self._micro_step += 1
        (loss * (self.loss_scale / self.config.micro_batches)).backward()
        for bucket in self.buckets:  # buckets some of whose parameters got no gradient
            if self._reduces_now() and self._ready[id(bucket)]:
                self._reduce(bucket)
        if self.config.zero_stage == 3:
            self._free(self.buckets[0])

    def _reduces_now(self) -> bool:
        return self.config.zero_stage >= 2 or self._micro_step == self.config.micro_batches

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        self._ready[id(bucket)] += 1
        if self._ready[id(bucket)] == len(bucket.params):
            self._ready[id(bucket)] = 0
            if self._reduces_now():
                self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> None:
        """Average this bucket's gradients over DP into this rank's shard, then release the
        full gradients (stage 0 keeps them whole: its 'shard' is everything)."""
        self._ready[id(bucket)] = 0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if self.tp.sequence_parallel:  # partial sums over sequence chunks (Korthikanti 4.2.2)
            replicated = [
                g for g, p in zip(grads, bucket.params, strict=True) if id(p) not in self._split_ids
            ]
            if replicated:
                flat = self.tp.group.all_reduce(torch.cat([g.reshape(-1) for g in replicated]))
                for g, part in zip(
                    replicated, flat.split([g.numel() for g in replicated]), strict=True
                ):
                    g.copy_(part.view_as(g))
        flat = bucket.flatten(grads)
        if self.config.zero_stage == 0:
            shard = self.dp.all_reduce(flat)
        else:
            shard = self.dp.reduce_scatter(flat)
        shard /= self.dp.size
        previous = self._grad_shards.get(id(bucket))
        self._grad_shards[id(bucket)] = shard if previous is None else previous + shard
        for p in bucket.params:
            p.grad = None
        if self.config.zero_stage == 3 and bucket is not self.buckets[0]:
            self._free(bucket)

    # ---- the optimizer step ---------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> StepStats:
        """Clip, step AdamW on this rank's fp32 shard, publish the new parameters."""
        self._micro_step = 0
        for piece, bucket, master in self.masters:
            shard = self._grad_shards[id(bucket)]
            master.grad = shard[piece.offset : piece.offset + piece.numel].float()
            if self.loss_scale != 1.0:
                master.grad /= self.loss_scale
        self._grad_shards.clear()
        if self._overflow():
            self.loss_scale /= 2.0
            self._good_steps = 0
            self.optimizer.zero_grad(set_to_none=True)
            return StepStats(float("nan"), True, self.loss_scale)
        norm = self._grad_norm()
        if self.config.grad_clip > 0 and norm > self.config.grad_clip:
            for _, _, master in self.masters:
                master.grad.mul_(self.config.grad_clip / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._publish()
        if self.config.precision == "fp16":
            self._good_steps += 1
            if self._good_steps % self.config.loss_scale_window == 0:
                self.loss_scale *= 2.0
        return StepStats(norm, False, self.loss_scale)

    def _overflow(self) -> bool:
        """Any non-finite gradient on any rank skips the step on every rank."""
        if self.config.precision != "fp16":
            return False
        bad = torch.zeros(1)
        for _, _, master in self.masters:
            if not torch.isfinite(master.grad).all():
                bad.fill_(1.0)
                break
        for group in (self.dp, self.tp.group):
            group.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def _grad_norm(self) -> float:
        """Global L2 norm, each element once: DP shards are disjoint (stages 1-3; at stage 0
        every DP rank holds the same full gradient), TP-split parameters are summed over TP,
        replicated ones counted once."""
        squares = torch.zeros(2, dtype=torch.float64)  # (TP-split, replicated)
        for piece, _, master in self.masters:
            split = id(piece.param) in self._split_ids
            squares[0 if split else 1] += master.grad.double().pow(2).sum()
        if self.config.zero_stage >= 1:
            self.dp.all_reduce(squares)
        split_part = self.tp.group.all_reduce(squares[:1].clone())
        return float((split_part[0] + squares[1]).sqrt())

    def _publish(self) -> None:
        """Write the updated fp32 shard into the parameters' dtype; all-gather at stages 1-2,
        keep as the shard at stage 3."""
        stage = self.config.zero_stage
        for piece, bucket, master in self.masters:
            value = master.detach().to(self.dtype)
            if stage == 3:
                shard = self._shard_data[id(bucket)]
                shard[piece.offset : piece.offset + piece.numel] = value
            else:
                piece.param.data.view(-1)[piece.start : piece.end] = value
        if stage in (1, 2):
            for bucket in self.buckets:
                full = bucket.flatten([p.detach() for p in bucket.params])
                gathered = self.dp.all_gather(self._my_shard(full, bucket))
                for p, view in zip(bucket.params, bucket.views(gathered), strict=True):
                    p.data.copy_(view)

    # ---- stage 3: parameters as shards ----------------------------------------------------

    def _my_shard(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        start = self.dp.rank * bucket.shard_numel
        return flat[start : start + bucket.shard_numel]

    def _gather(self, bucket: Bucket) -> None:
        if id(bucket) in self._gathered:
            return
        full = self.dp.all_gather(self._shard_data[id(bucket)])
        for p, view in zip(bucket.params, bucket.views(full), strict=True):
            p.data = view
        self._gathered.add(id(bucket))

    def _free(self, bucket: Bucket) -> None:
        for p in bucket.params:
            p.data = torch.empty(0, dtype=self.dtype, device=p.device)
        self._gathered.discard(id(bucket))

    def _after_forward(self, bucket: Bucket, output: Any) -> None:
        """Free the unit's parameters; gather them again when its backward begins."""
        self._free(bucket)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: (self._gather(bucket), grad)[1])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as the tp=1, dp=1 model has it (gathered across DP and TP);
        every rank must call it."""
        if self.config.zero_stage == 3:
            for bucket in self.buckets:
                self._gather(bucket)
        state = {
            name: tensor.detach().contiguous().clone()
            for name, tensor in named_full_tensors(self.module, self.tp.group)
        }
        if self.config.zero_stage == 3:
            for bucket in self.buckets:
                self._free(bucket)
        return state

    # ---- accounting -----------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for model states at the peak of a step."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        full = sum(b.numel - b.padding for b in self.buckets)
        shard = sum(b.shard_numel for b in self.buckets)
        stage = self.config.zero_stage
        params = element * (shard if stage == 3 else full)
        grads = element * (shard if stage >= 2 else full)
        optimizer = sum(m.numel() for _, _, m in self.masters) * 4
        optimizer += sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return {"parameters": params, "gradients": grads, "optimizer": optimizer}
