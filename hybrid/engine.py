"""Engine: a model built from hybrid layers, trained with ZeRO stage 0-3 along DP.

    engine = Engine(model, topology, tp, EngineConfig(zero_stage=2, micro_batches=2), units)
    for x, y in micro_batches:
        engine.backward(engine(x, y))
    stats = engine.step(lr)

ZeRO (Rajbhandari et al. 2020, section 5; DESIGN.md section 2), per DP group of one TP rank:
- stage 0: everything replicated; gradients all-reduced once per step;
- stage 1: fp32 master weights and Adam moments only for this rank's 1/dp shard; gradients
  accumulated in full over the micro-batches, reduce-scattered during the last backward
  (each bucket's full buffer released once reduced, as at stage 2), the optimizer steps on
  the shard, updated parameters all-gathered;
- stage 2: gradients kept only as shards: each bucket is reduce-scattered from gradient
  hooks during backward and its full gradients released at once;
- stage 3: parameters kept only as shards (hybrid.zero.gather).
Buckets are the `units` (e.g. transformer layers) plus one for the remaining parameters.

Memory layout: at stages 0-2 every parameter is a view into its bucket's flat buffer, so
the optimizer steps on (a slice of) that buffer and the all-gather writes into it with no
copy. Gradients are copied once, from autograd into the bucket's flat gradient buffer, and
released. A bucket's buffer is opened at its first gradient in backward and, at every
stage, gone after the step (stage 0 keeps it only from backward to the step), so like a
plain loop with `zero_grad(set_to_none=True)` no gradient lives through forward. That
buffer, the micro-batch sums, the DP reduction and the shards are fp32 by default under
bf16 and fp16 (`grad_reduce_dtype`, as Megatron and DeepSpeed do), or the 16-bit compute
dtype for half the traffic. In fp32 the fp32 master *is* the parameter
shard: no second copy.
Collectives are issued asynchronously from the hooks and waited for at the end of
backward, so communication overlaps the rest of backward.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybrid.checkpoint.full_state import full_tensors
from hybrid.distributed.comm import Handle
from hybrid.distributed.topology import Topology
from hybrid.tensor_parallel import TensorParallel
from hybrid.zero.accounting import model_state_bytes, nbytes, transient_bytes
from hybrid.zero.bucket import build_buckets, max_bucket_numel
from hybrid.zero.gather import ParameterGatherer
from hybrid.zero.optimizer import make_adamw
from hybrid.zero.publish import ParameterPublisher
from hybrid.zero.state import materialise, replace_meta_parameters

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_REDUCE_DTYPES = ("fp32", "bf16")


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
    # Stages 0-2: consecutive units share a bucket up to this size (DDP's default cap), so
    # a small model is reduced in few, large collectives. Stage 3 gathers unit by unit.
    bucket_mb: float = 25.0
    # Gradients' dtype from autograd's copy on: the flat buffers, the micro-batch sum, the
    # DP reduction and the shards. "fp32" (Megatron's and DeepSpeed's default) sums bf16 or
    # fp16 gradients without rounding each addition to 8 (or 11) mantissa bits; "bf16"
    # keeps them in the 16-bit compute dtype (bf16 or fp16): half the reduction traffic.
    # fp32 precision reduces in fp32 either way.
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16
    # Stages 1-2: each bucket's parameter all-gather after the step is waited for just
    # before the first forward that reads it (hybrid.zero.publish), so it overlaps the
    # next forward; False waits for all of them in the step. Same values either way.
    overlap_param_gather: bool = True


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
        device: torch.device | None = None,
    ) -> None:
        if config.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={config.zero_stage} must be 0, 1, 2 or 3")
        if config.precision not in DTYPES:
            raise ValueError(f"precision={config.precision!r} must be one of {list(DTYPES)}")
        self.module, self.topology, self.tp, self.config = model, topology, tp, config
        if config.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(
                f"grad_reduce_dtype={config.grad_reduce_dtype!r} must be one of "
                f"{list(GRAD_REDUCE_DTYPES)}"
            )
        self.dtype = DTYPES[config.precision]
        fp32_grads = config.grad_reduce_dtype == "fp32"
        self.grad_dtype = torch.float32 if fp32_grads else self.dtype
        self.dp = topology.dp_group
        self.stage = config.zero_stage
        if device is None:
            real = [p.device for p in model.parameters() if p.device.type != "meta"]
            device = real[0] if real else torch.device("cpu")
        self.device = device
        self.loss_scale = config.initial_loss_scale if config.precision == "fp16" else 1.0
        self.good_steps = 0  # fp16 steps since the loss scale last changed (checkpointed)
        self._micro_step = 0

        units = list(units or [])
        sharded = self.stage >= 1
        dp_size, dp_rank = (self.dp.size, self.dp.rank) if sharded else (1, 0)
        element = torch.tensor([], dtype=self.dtype).element_size()
        max_numel = max_bucket_numel(self.stage, config.bucket_mb, element)
        self.buckets = build_buckets(model, units, dp_size, dp_rank, max_numel)
        model.to(self.dtype)  # buffers; parameters move into the buckets' flat tensors
        self.states = [materialise(model, b, self.stage, self.dtype, device) for b in self.buckets]
        replace_meta_parameters(model, self.buckets, self.states)
        self._where = {
            id(p): (k, i) for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)
        }
        self._pending: list[tuple[int, Handle, torch.Tensor, torch.Tensor]] = []
        self.peak_buffer_bytes = 0
        self.grad_bytes = 0  # gradient bytes held when the last backward ended
        self.optimizer = make_adamw(
            self.states, self.buckets, config.weight_decay, config.betas, config.eps, self.device
        )
        # The hook holds the engine weakly: a parameter's hooks live where the garbage
        # collector cannot see them, so a strong reference would keep every engine (and
        # its shards) alive for as long as the model is, even after the engine is dropped.
        engine = weakref.ref(self)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda param: engine()._on_grad(param))

        self.gatherer: ParameterGatherer | None = None
        if self.stage == 3:
            self.gatherer = ParameterGatherer(
                self.buckets, [s.param_shard for s in self.states], self.dp, self.dtype, device
            )
            self.gatherer.hook(model, units)
        self.publisher: ParameterPublisher | None = None
        if self.stage in (1, 2):
            self.publisher = ParameterPublisher(
                [s.param_flat for s in self.states], [s.param_shard for s in self.states], self.dp
            )
            self.publisher.hook(model, units, lambda unit: self._bucket_of(unit))

    def _bucket_of(self, unit: nn.Module) -> int:
        """The bucket holding `unit`'s parameters (a unit never spans two)."""
        first = next(unit.parameters(), None)
        return self._where[id(first)][0] if first is not None else 0

    @property
    def adam_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps not counted)."""
        return int(next(iter(self.optimizer.state.values()))["step"].item())

    def set_adam_steps(self, steps: int) -> None:
        for state in self.optimizer.state.values():
            state["step"].fill_(steps)

    # ---- forward and backward -------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss. The gradient of the mean over the global
        batch is the DP sum of each rank's gradient scaled by 1/(micro_batches x dp); the
        scale (and the fp16 loss scale) is applied to the loss. Gradient reduction runs from
        hooks: every micro-batch at stages 2-3, the last one only at stages 0-1."""
        self._micro_step += 1
        scale = self.loss_scale / (self.config.micro_batches * self.dp.size)
        (loss * scale).backward()
        for k, state in enumerate(self.states):  # buckets some of whose params got no grad
            if state.ready and self._reduces_now():
                self._reduce(k)
            state.ready = 0
        self._finish_reductions()

    def _reduces_now(self) -> bool:
        return self.stage >= 2 or self._micro_step == self.config.micro_batches

    def _on_grad(self, param: nn.Parameter) -> None:
        """Copy the new gradient into the bucket's flat buffer (accumulating across
        micro-batches at stages 0-1) and release it; reduce once the bucket is complete."""
        k, i = self._where[id(param)]
        bucket, state = self.buckets[k], self.states[k]
        if state.grad_flat is None:
            state.grad_flat = torch.empty(bucket.numel, dtype=self.grad_dtype, device=self.device)
            self._note_buffers()
        view = bucket.view(state.grad_flat, i)
        if state.filled[i]:
            view.add_(param.grad)  # in fp32 buffers: the 16-bit gradient summed in fp32
        else:
            view.copy_(param.grad)
            state.filled[i] = True
        param.grad = None
        state.ready += 1
        if state.ready == len(bucket.params) and self._reduces_now():
            self._reduce(k)

    def _reduce(self, k: int) -> None:
        """Start summing bucket k's gradients over DP into this rank's shard."""
        bucket, state = self.buckets[k], self.states[k]
        state.ready = 0
        flat = state.grad_flat
        if flat is None:  # no gradient reached this bucket in this step
            flat = state.grad_flat = torch.empty(
                bucket.numel, dtype=self.grad_dtype, device=self.device
            )
        for i, filled in enumerate(state.filled):
            if not filled:
                bucket.view(flat, i).zero_()
            state.filled[i] = False
        flat[bucket.numel - bucket.padding :].zero_()
        if self.tp.sequence_parallel:  # partial sums over sequence chunks (Korthikanti 4.2.2)
            for segment in bucket.full_segments:
                if not segment.kind.split:
                    self.tp.group.all_reduce(flat[segment.start : segment.end])
        if self.stage == 0:
            out, handle = flat, self.dp.all_reduce_async(flat)
        else:
            out = torch.empty(bucket.shard_numel, dtype=self.grad_dtype, device=self.device)
            handle = self.dp.reduce_scatter_into(out, flat)
        self._pending.append((k, handle, out, flat))
        if self.stage >= 1:
            state.grad_flat = None  # the pending entry keeps it alive until reduced
        if self.gatherer is not None:
            self.gatherer.free(k)
        self._note_buffers()
        if self.stage >= 1:
            # ZeRO-2's point is that full gradients never all exist at once (Rajbhandari
            # et al. 5.2): wait for the reduction issued one bucket earlier (done by now,
            # a layer's backward later) and free its full buffer, so at most two are in
            # flight however many layers there are. Stage 1 does the same in its one
            # reducing backward: after it, only the shards it steps on remain.
            self._drain(keep=1)

    def _drain(self, keep: int) -> None:
        """Wait for all but the newest `keep` pending reductions, oldest first, and fold
        each output into its bucket's gradient shard (summed over micro-batches at 2-3)."""
        while len(self._pending) > keep:
            k, handle, out, _ = self._pending.pop(0)
            handle.wait()
            state = self.states[k]
            if state.grad_shard is None or self.stage < 2:
                state.grad_shard = out
            else:
                state.grad_shard += out

    def _finish_reductions(self) -> None:
        self._drain(keep=0)
        self._note_buffers()
        held = (s.grad_flat if self.stage == 0 else s.grad_shard for s in self.states)
        self.grad_bytes = sum(nbytes(t) for t in held)

    # ---- the optimizer step ---------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> StepStats:
        """Clip, step AdamW on this rank's fp32 shard, publish the new parameters."""
        self._micro_step = 0
        self.wait_for_parameters()  # in fp32 the master stepped on is a gather's input
        if self.gatherer is not None:
            self.gatherer.check_idle()
        grads = []
        for state in self.states:
            grad = state.grad_shard
            if grad is None:  # nothing reduced into this bucket: zero gradient
                grad = torch.zeros_like(state.master, dtype=self.grad_dtype)
            if grad.dtype != torch.float32:
                grad = grad.float()
            if self.loss_scale != 1.0:  # fp16: unscaled in fp32, the shard's own if fp32
                grad /= self.loss_scale
            grads.append(grad)
            for segment, view in state.master_segments:
                view.grad = grad[segment.start : segment.end]
            state.grad_shard = None
        if self._overflow(grads):
            self.loss_scale /= 2.0
            self.good_steps = 0
            self._release_gradients()
            return StepStats(float("nan"), True, self.loss_scale)
        norm = self._grad_norm()
        if not math.isfinite(norm):
            # A NaN or inf gradient anywhere (the norm is reduced over DP and TP, so every
            # rank sees it): no update, on every rank alike. The caller decides whether to
            # go on (train.on_nonfinite).
            self._release_gradients()
            return StepStats(norm, True, self.loss_scale)
        if self.config.grad_clip > 0 and norm > self.config.grad_clip:
            torch._foreach_mul_(grads, self.config.grad_clip / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._release_gradients()
        self.publish_masters()
        if self.config.precision == "fp16":
            self.good_steps += 1
            if self.good_steps % self.config.loss_scale_window == 0:
                self.loss_scale *= 2.0
        return StepStats(norm, False, self.loss_scale)

    def _release_gradients(self) -> None:
        """Drop every gradient of the step once it is used (or skipped): the master views'
        `.grad` and, at stage 0, the full flat buffers too. Like a plain loop's
        `zero_grad(set_to_none=True)`, nothing of the gradients then lives through the next
        forward, on top of its activations; the next backward opens each bucket's buffer
        again at its first gradient (`_on_grad`)."""
        self.optimizer.zero_grad(set_to_none=True)
        for state in self.states:
            state.grad_flat = None

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        """Any non-finite gradient on any rank skips the step on every rank."""
        if self.config.precision != "fp16":
            return False
        bad = torch.zeros(1, device=self.device)
        for grad in grads:
            bad = torch.maximum(bad, (~torch.isfinite(grad)).any().float().reshape(1))
        for group in (self.dp, self.tp.group):
            group.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def _grad_norm(self) -> float:
        """Global L2 norm, each element once: DP shards are disjoint (stages 1-3; at stage 0
        every DP rank holds the same full gradient), TP-split parameters are summed over TP,
        replicated ones counted once."""
        kinds = [
            (segment.kind.split, view.grad)
            for state in self.states
            for segment, view in state.master_segments
        ]
        squares = torch.zeros(2, dtype=torch.float64, device=self.device)  # (split, replicated)
        for index, split in enumerate((True, False)):
            grads = [grad for is_split, grad in kinds if is_split == split]
            if grads:
                norms = torch.stack(torch._foreach_norm(grads)).double()
                squares[index] = norms.square().sum()
        if self.stage >= 1:
            self.dp.all_reduce(squares)
        # The replicated part is the same on every TP rank unless it is not finite on one:
        # its non-finite flag rides along, so every rank returns the same (NaN) norm.
        bad = (~torch.isfinite(squares[1:])).double()
        split_part = self.tp.group.all_reduce(torch.cat([squares[:1], bad]))
        if split_part[1] > 0:
            return float("nan")
        return float((split_part[0] + squares[1]).sqrt())

    def publish_masters(self) -> None:
        """Write the updated fp32 master into the parameters' shard (the same memory in
        fp32), then all-gather the shards at stages 1-2 (hybrid.zero.publish: waited for
        by the next forward, bucket by bucket, unless overlap_param_gather is off); stage
        3 keeps only the shard."""
        self.wait_for_parameters()
        for state in self.states:
            if state.master is not state.param_shard:
                state.param_shard.copy_(state.master)
        if self.publisher is not None:
            self.publisher.start()
            if not self.config.overlap_param_gather:
                self.publisher.wait_all()

    def wait_for_parameters(self) -> None:
        """Stages 1-2: every parameter gathered, nothing in flight. For whatever reads the
        parameters other than through forward, or writes the shards (a checkpoint load)."""
        if self.publisher is not None:
            self.publisher.wait_all()

    # ---- the full model (hybrid.checkpoint.full_state)
    # ------------------------------------------------

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tp=1 tensor) for every parameter, one bucket gathered at a time; every
        rank must run it to the end (hybrid.checkpoint.full_state.full_tensors)."""
        return full_tensors(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as the tp=1, dp=1 model has it, copied: the whole model on every
        rank, for tests and one-process tools. A run's own output streams `full_tensors`."""
        return {name: tensor.clone() for name, tensor in full_tensors(self)}

    # ---- accounting (hybrid.zero.accounting) --------------------------------------------

    def _note_buffers(self) -> None:
        """Track the peak bytes of transient communication buffers."""
        held = transient_bytes(self.states, self._pending, self.stage, self.gatherer)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, held)

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's model-state bytes, counted from its tensors (see
        hybrid.zero.accounting.model_state_bytes)."""
        return model_state_bytes(self.states, self.grad_bytes, self.peak_buffer_bytes)
