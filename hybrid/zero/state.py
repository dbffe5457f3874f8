"""The tensors one bucket owns on this rank, and their creation from the model.

Stages 0-2: `param_flat` holds every parameter of the bucket (each parameter's `.data` is a
view into it) and `param_shard` is this rank's slice of it. Stage 3: only `param_shard`
exists between uses (hybrid.zero.gather). `master` is the fp32 copy the optimizer steps
on: `param_shard` itself when the model is fp32 (no second copy), a separate fp32 tensor
for bf16 and fp16 (mixed precision, ZeRO's K = 12 bytes per parameter). Gradients
(`grad_flat`, `grad_shard`) are in the engine's gradient dtype (fp32 by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybrid.zero.bucket import FlatBucket


@dataclass
class BucketState:
    param_flat: torch.Tensor | None
    param_shard: torch.Tensor
    master: torch.Tensor
    grad_flat: torch.Tensor | None  # full gradients (stage 0: from backward to the step)
    filled: list[bool]  # which parameters' gradients are in grad_flat this step
    grad_shard: torch.Tensor | None = None  # reduced gradients of this rank's shard
    exp_avg: torch.Tensor | None = None  # Adam's moments over the master shard (fp32)
    exp_avg_sq: torch.Tensor | None = None
    ready: int = 0  # parameters whose gradient arrived in this backward, not yet reduced
    arrived: list[bool] = field(default_factory=list)  # ... and whether reduced or not
    master_segments: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def arrive(self, index: int, name: str) -> None:
        """Parameter `index`'s gradient arrived in this backward. A second one is an error,
        not a sum: its bucket may be reduced already."""
        if self.arrived[index]:
            raise RuntimeError(
                f"{name} received two gradients in one backward: a parallel Linear's weight "
                "used outside it too (its sink wrote one); use it through the layer only"
            )
        self.arrived[index] = True

    def end_backward(self) -> None:
        self.ready, self.arrived = 0, [False] * len(self.arrived)

    def zero_unfilled(self, bucket: FlatBucket, flat: torch.Tensor) -> None:
        """Zero the views of `flat` no gradient reached in this step, and its padding,
        before it is reduced; every view counts as unfilled for the next step."""
        for i, filled in enumerate(self.filled):
            if not filled:
                bucket.view(flat, i).zero_()
            self.filled[i] = False
        flat[bucket.numel - bucket.padding :].zero_()

    @property
    def param_storage(self) -> torch.Tensor:
        return self.param_flat if self.param_flat is not None else self.param_shard


def initial_value(source: Any, name: str, param: nn.Parameter) -> torch.Tensor:
    """A parameter's value: its data, or, for a parameter on the meta device, this TP
    rank's slice of its initial value from the source (`source.initial_value(name)`: the
    model itself, or the values the Engine was given, e.g. hybrid.wrap's MetaInit)."""
    if param.device.type != "meta":
        return param.detach()
    make = getattr(source, "initial_value", None)
    if make is None:
        raise ValueError(
            f"parameter {name} is on the meta device but {type(source).__name__} has no "
            "initial_value(name) to materialise it; build the model on a real device, or "
            "wrap it with hybrid.wrap, which initialises a meta model shard by shard"
        )
    return make(name)


def initial_values(
    source: Any, name: str, param: nn.Parameter, start: int, end: int
) -> torch.Tensor:
    """Elements [start, end) of the flattened `initial_value`, as a 1-D tensor. For a meta
    parameter the source is asked for just those (`source.initial_values(name, start,
    end)`, which draws only them), else for the whole TP slice, then sliced."""
    if param.device.type != "meta":
        return param.detach().reshape(-1)[start:end]
    make = getattr(source, "initial_values", None)
    if make is not None:
        return make(name, start, end)
    return initial_value(source, name, param).reshape(-1)[start:end]


@torch.no_grad()
def buffers_to(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating-point buffers in `dtype`. Not `model.to(dtype)`: the parameters
    are copied into the buckets' flat tensors (a meta one replaced), and converting a
    parameter under a FakeTensorMode (the rehearsal's fake compute) swaps the tensor, which
    fails where the memory tracker holds a weak reference to it."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[key] = buffer.to(dtype)


def materialise(
    source: Any,
    bucket: FlatBucket,
    stage: int,
    dtype: torch.dtype,
    device: torch.device,
) -> BucketState:
    """Allocate the bucket's tensors on `device` and fill them from the parameters (or
    their initial values): all of them at stages 0-2, only this rank's shard at stage 3,
    so under stage 3 the full bucket never exists on one rank, and a model built on meta
    computes (draws) only the elements of that shard; `source` gives a meta parameter's
    values (`initial_values`, see above). No gradient buffer is made here:
    the engine opens each bucket's at its first gradient, in `grad_dtype`."""
    if stage < 3:
        flat = torch.zeros(bucket.numel, dtype=dtype, device=device)
        for i, (name, p) in enumerate(zip(bucket.names, bucket.params, strict=True)):
            view = bucket.view(flat, i)
            view.copy_(initial_value(source, name, p))
            if p.device.type != "meta":  # meta ones are replaced: replace_meta_parameters
                p.data = view
        shard = bucket.shard(flat)
    else:
        flat = None
        shard = torch.zeros(bucket.shard_numel, dtype=dtype, device=device)
        # Only this rank's pieces are asked for: a seeded model draws 1/dp of its TP slice.
        for i, start, end, offset in bucket.pieces():
            value = initial_values(source, bucket.names[i], bucket.params[i], start, end)
            shard[offset : offset + end - start] = value
    master = shard if dtype == torch.float32 else shard.float()
    n = len(bucket.params)
    state = BucketState(flat, shard, master, None, [False] * n, arrived=[False] * n)
    state.exp_avg, state.exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    return state


def replace_meta_parameters(
    model: nn.Module, buckets: list[FlatBucket], states: list[BucketState]
) -> None:
    """Swap every meta parameter for a real one (a meta tensor cannot take real data):
    a view into the bucket's flat buffer at stages 0-2, empty at stage 3 until gathered.
    Tied parameters stay tied: one replacement per parameter object."""
    replacement: dict[int, nn.Parameter] = {}
    for bucket, state in zip(buckets, states, strict=True):
        for i, p in enumerate(bucket.params):
            if p.device.type != "meta":
                continue
            if state.param_flat is not None:
                data = bucket.view(state.param_flat, i)
            else:
                data = state.param_shard.new_empty(0)
            replacement[id(p)] = bucket.params[i] = nn.Parameter(data, p.requires_grad)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in replacement:
                module._parameters[name] = replacement[id(p)]
