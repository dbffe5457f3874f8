"""Engine: a model built from hybrid layers, trained with ZeRO stage 0-3 along DP.

    engine = Engine(model, topology, tp, EngineConfig(zero_stage=2, micro_batches=2), units)
    for x, y in micro_batches:
        engine.backward(engine(x, y))
    stats = engine.step(lr)

ZeRO (Rajbhandari et al. 2020, section 5; DESIGN.md section 2), per DP group of one TP rank:
- stage 0: everything replicated; gradients all-reduced once per step (at dp=1 in fp32,
  autograd's own gradients are stepped on: no buffer, no copy, as in a plain loop);
- stage 1: fp32 master weights and Adam moments only for this rank's 1/dp shard; gradients
  accumulated in full over the micro-batches, reduce-scattered during the last backward
  (each bucket's full buffer released once reduced, as at stage 2), the optimizer steps on
  the shard, updated parameters all-gathered;
- stage 2: gradients kept only as shards: each bucket is reduce-scattered from gradient
  hooks during backward and its full gradients released at once;
- stage 3: parameters kept only as shards (hybrid.zero.gather).
Buckets are the `units` (e.g. transformer layers) plus one for the remaining parameters.

Memory layout: at stages 0-2 every parameter is a view into its bucket's flat buffer, so
the optimizer steps on (a slice of) it and the all-gather writes into it with no copy.
A gradient reaches its bucket's flat gradient buffer (opened at the bucket's first gradient,
gone after the step at every stage, so, as in a plain loop with `zero_grad(set_to_none=True)`,
no gradient lives through forward) copied once from autograd, or, for our parallel Linears'
weights in fp32, written there by their backward's matmul (weight_grads). Under bf16/fp16
that buffer and the DP reduction are fp32 by default (`grad_reduce_dtype`); in fp32 the
master *is* the parameter shard. DP reductions are issued asynchronously from the hooks:
stage 0 waits at the end of backward; at stages 1-3 a bucket's first gradient waits for
the one in flight before its buffer opens (one unit's full buffer at a time, ZeRO 5.2).
With sequence parallelism the TP all-reduce of replicated gradients runs in the hook first.

Construction: check the config (hybrid.engine_config), build the buckets, materialise
their flat storage, make the optimizer on the shards, attach gradient and parameter hooks,
return the build's freed host memory (hybrid.distributed.host_memory).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hybrid.distributed.comm import Handle
from hybrid.distributed.host_memory import trim_freed_memory
from hybrid.distributed.topology import Topology
from hybrid.engine_config import (
    DTYPES,
    GRAD_REDUCE_DTYPES,
    EngineConfig,
    StepStats,
    check_engine_config,
    keeps_autograd_gradients,
)
from hybrid.tensor_parallel import TensorParallel, attach_weight_gradient_sinks
from hybrid.tensor_parallel.weight_grads import Write
from hybrid.zero.accounting import model_state_bytes, nbytes, transient_bytes
from hybrid.zero.bucket import FlatBucket, build_buckets, max_bucket_numel
from hybrid.zero.full_model import gathered_full_tensors
from hybrid.zero.gather import ParameterGatherer
from hybrid.zero.gradients import any_overflow, global_grad_norm, step_gradients
from hybrid.zero.optimizer import make_adamw, step_adamw
from hybrid.zero.publish import ParameterPublisher
from hybrid.zero.state import BucketState, buffers_to, materialise, replace_meta_parameters


class Engine:
    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        tp: TensorParallel,
        config: EngineConfig,
        units: list[nn.Module] | None = None,
        device: torch.device | None = None,
        values: Any = None,
    ) -> None:
        # values: gives a meta parameter's initial values by name (the model by default).
        check_engine_config(config)
        self.module, self.topology, self.tp, self.config = model, topology, tp, config
        self.dtype = DTYPES[config.precision]
        self.grad_dtype = torch.float32 if config.grad_reduce_dtype == "fp32" else self.dtype
        self.dp, self.stage = topology.dp_group, config.zero_stage
        if device is None:
            real = [p.device for p in model.parameters() if p.device.type != "meta"]
            device = real[0] if real else torch.device("cpu")
        self.device = device
        self.loss_scale = config.initial_loss_scale if config.precision == "fp16" else 1.0
        self.good_steps = 0  # fp16 steps since the loss scale last changed (checkpointed)
        self._micro_step = 0
        self._pending: list[tuple[int, Handle, torch.Tensor, torch.Tensor]] = []
        self.peak_buffer_bytes = 0
        self.grad_bytes = 0  # gradient bytes held when the last backward ended
        self.autograd_grads = keeps_autograd_gradients(config, self.dp.size, tp.sequence_parallel)
        units = list(units or [])
        self._build_buckets(units)
        self._materialise(model if values is None else values)
        self.optimizer = make_adamw(self.states, self.buckets, config, device, self.autograd_grads)
        self._attach_gradient_hooks()
        self._attach_parameter_hooks(units)
        trim_freed_memory(device)  # the build's freed host memory back to the OS

    def _build_buckets(self, units: list[nn.Module]) -> None:
        """The units' parameters in flat buckets (consecutive units share one up to
        `bucket_mb` at stages 0-2), each with this rank's 1/dp shard at stages 1-3."""
        sharded = self.stage >= 1
        dp_size, dp_rank = (self.dp.size, self.dp.rank) if sharded else (1, 0)
        element = torch.tensor([], dtype=self.dtype).element_size()
        max_numel = max_bucket_numel(self.stage, self.config.bucket_mb, element)
        self.buckets = build_buckets(self.module, units, dp_size, dp_rank, max_numel)

    def _materialise(self, values: Any) -> None:
        """Each bucket's flat storage on the device (a meta model is initialised here, shard
        by shard at stage 3); the parameters become views into it, found by `_where`."""
        model = self.module
        buffers_to(model, self.dtype)  # parameters move into the buckets' flat tensors
        dtype, device = self.dtype, self.device
        self.states = [materialise(values, b, self.stage, dtype, device) for b in self.buckets]
        replace_meta_parameters(model, self.buckets, self.states)
        # After the replacement: a meta parameter's new Parameter is a new object.
        self._where = {
            id(p): (k, i) for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)
        }

    def _attach_gradient_hooks(self) -> None:
        """Gradients go to their buckets: autograd's by `_on_grad`, or by a sink (weight_grads)."""
        if self.autograd_grads:
            return
        # The hook holds the engine weakly: a parameter's hooks live where the garbage
        # collector cannot see them; a strong reference would keep a dropped engine alive.
        engine = weakref.ref(self)
        for p in self.module.parameters():
            p.register_post_accumulate_grad_hook(lambda param: engine()._on_grad(param))
        if self.grad_dtype == self.dtype == torch.float32:  # fp32: no 16-bit product to widen
            attach_weight_gradient_sinks(self.module, lambda p, w: engine()._receive(p, w))

    def _attach_parameter_hooks(self, units: list[nn.Module]) -> None:
        """Stage 3 gathers each unit's parameters around its forward and backward
        (hybrid.zero.gather); stages 1-2 wait, before each unit's forward, for its bucket's
        all-gather the step started (hybrid.zero.publish)."""
        model, device = self.module, self.device
        shards = [s.param_shard for s in self.states]
        self.gatherer: ParameterGatherer | None = None
        if self.stage == 3:
            self.gatherer = ParameterGatherer(self.buckets, shards, self.dp, self.dtype, device)
            self.gatherer.hook(model, units)
        self.publisher: ParameterPublisher | None = None
        if self.stage in (1, 2):
            flats = [s.param_flat for s in self.states]
            self.publisher = ParameterPublisher(flats, shards, self.dp)
            self.publisher.hook(model, units, lambda unit: self._bucket_of(unit))

    def _bucket_of(self, unit: nn.Module) -> int:  # a unit's parameters share one bucket
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
        """Backward of one micro-batch's mean loss, scaled by (fp16's loss scale) / (micro
        batches x dp): the global batch's mean gradient is the DP sum of the ranks'. Hooks
        reduce the gradients: every micro-batch at stages 2-3, the last one at stages 0-1."""
        self._micro_step += 1
        scale = self.loss_scale / (self.config.micro_batches * self.dp.size)
        (loss * scale).backward()
        for k, state in enumerate(self.states):  # buckets some of whose params got no grad
            if state.ready and self._reduces_now():
                self._reduce(k)
            state.end_backward()
        self._finish_reductions()

    def _reduces_now(self) -> bool:
        return self.stage >= 2 or self._micro_step == self.config.micro_batches

    def _on_grad(self, param: nn.Parameter) -> None:
        """Copy autograd's gradient into the bucket (a 16-bit one summed in fp32 buffers) and
        release it; None where a sink wrote it (weight_grads: the hook runs all the same)."""
        grad, param.grad = param.grad, None
        if grad is not None:
            self._receive(param, lambda view, add: view.add_(grad) if add else view.copy_(grad))

    def _receive(self, param: nn.Parameter, write: Write) -> None:
        """`write` param's gradient into its view of the bucket's flat buffer (added to it
        across micro-batches at stages 0-1); reduce once the bucket is complete."""
        k, i = self._where[id(param)]
        bucket, state = self.buckets[k], self.states[k]
        state.arrive(i, bucket.names[i])
        if state.grad_flat is None:
            if self.stage >= 1:  # the reduction before it ends first: one full buffer at once
                self._drain(keep=0)
            self._open(state, bucket)
        write(bucket.view(state.grad_flat, i), state.filled[i])
        state.filled[i] = True
        state.ready += 1
        if state.ready == len(bucket.params) and self._reduces_now():
            self._reduce(k)

    def _reduce(self, k: int) -> None:
        """Start summing bucket k's gradients over DP into this rank's shard."""
        bucket, state = self.buckets[k], self.states[k]
        state.ready = 0
        flat = state.grad_flat if state.grad_flat is not None else self._open(state, bucket)
        state.zero_unfilled(bucket, flat)  # a bucket no gradient reached is all zeros
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
            # Full gradients never all exist at once (ZeRO 5.2): the next bucket's first
            # gradient waits for this one (`_receive`), an open one (the root's) here.
            self._drain(keep=1)

    def _open(self, state: BucketState, bucket: FlatBucket) -> torch.Tensor:
        state.grad_flat = torch.empty(bucket.numel, dtype=self.grad_dtype, device=self.device)
        self._note_buffers()
        return state.grad_flat

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
        held = [s.grad_flat if self.stage == 0 else s.grad_shard for s in self.states]
        held += [p.grad for p in self.module.parameters()] if self.autograd_grads else []
        self.grad_bytes = sum(nbytes(t) for t in held)

    # ---- the optimizer step ---------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> StepStats:
        """Clip, step AdamW on this rank's fp32 shard, publish the new parameters."""
        self._micro_step = 0
        self.wait_for_parameters()  # in fp32 the master stepped on is a gather's input
        if self.gatherer is not None:
            self.gatherer.check_idle()
        grads = step_gradients(
            self.states, self.buckets, self.grad_dtype, self.loss_scale, self.autograd_grads
        )
        if self.config.precision == "fp16" and any_overflow(
            grads, (self.dp, self.tp.group), self.device
        ):
            self.loss_scale /= 2.0
            self.good_steps = 0
            self._release_gradients()
            return StepStats(float("nan"), True, self.loss_scale)
        norm = global_grad_norm(self.states, self.stage, self.dp, self.tp.group, self.device)
        if not math.isfinite(norm):
            # A NaN or inf gradient anywhere (the norm is reduced over DP and TP): no update,
            # on every rank alike; the caller decides whether to go on (train.on_nonfinite).
            self._release_gradients()
            return StepStats(norm, True, self.loss_scale)
        clip = self.config.grad_clip
        divisor = (norm + 1e-6) / clip if 0 < clip < norm else None
        step_adamw(self.optimizer, lr, divisor, self.device)
        self._release_gradients()
        self.publish_masters()
        if self.config.precision == "fp16":
            self.good_steps += 1
            if self.good_steps % self.config.loss_scale_window == 0:
                self.loss_scale *= 2.0
        return StepStats(norm, False, self.loss_scale)

    def _release_gradients(self) -> None:
        """Drop the step's gradients once used (or skipped), as a plain loop's
        `zero_grad(set_to_none=True)` does: none lives through the next forward."""
        self.optimizer.zero_grad(set_to_none=True)
        for state in self.states:
            state.grad_flat = None

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

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tp=1 tensor) for every parameter, one bucket gathered at a time; every
        rank must run it to the end (hybrid.zero.full_model.gathered_full_tensors)."""
        self.wait_for_parameters()  # stages 1-2: the step's gathers may still be in flight
        yield from gathered_full_tensors(self.module, self.buckets, self.gatherer, self.tp)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as the tp=1, dp=1 model has it, copied: the whole model on every
        rank, for tests and one-process tools. A run's own output streams `full_tensors`."""
        return {name: tensor.clone() for name, tensor in self.full_tensors()}

    def _note_buffers(self) -> None:
        """Track the peak bytes of transient communication buffers."""
        held = transient_bytes(self.states, self._pending, self.stage, self.gatherer)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, held)

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's model-state bytes, counted from its tensors (see
        hybrid.zero.accounting.model_state_bytes)."""
        return model_state_bytes(self.states, self.grad_bytes, self.peak_buffer_bytes)


__all__ = ["DTYPES", "GRAD_REDUCE_DTYPES", "Engine", "EngineConfig", "StepStats"]
