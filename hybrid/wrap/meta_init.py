"""A model built on the meta device, initialised shard by shard by its own init code.

A module's initialisation (`reset_parameters`, a Hugging Face model's `_init_weights`) is a
sequence of in-place, elementwise operations on each parameter: `normal_`, `uniform_`,
`fill_`, `zero_`, and for `trunc_normal_` also `erfinv_`, `mul_`, `add_`, `clamp_`.
Run on meta parameters those compute nothing, so MetaInit runs the model's own init once
on meta and records, per parameter, each operation and the part of the parameter it
wrote (a view: the whole tensor, or e.g. an embedding's padding row). `initial_values(name,
start, end)` then replays the record on a tensor of just those elements: a ZeRO-3 rank
draws its 1/dp shard and never the full parameter (70B at dp=8: 8.75B elements a rank, not
70B). The values follow the same distributions as the model's own init, not the same
random draws. An operation that is not elementwise (a read of the parameter's values)
stops the recording with an error naming it and the parameter; an init that does nothing
on meta (torch's orthogonal_, dirac_, sparse_) leaves the parameter unwritten, an error
too.

Buffers are small and not sharded: a meta buffer is allocated on the device before the
init runs, and the init writes it for real (a rotary embedding's frequencies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# In-place elementwise operations: every element's new value depends only on its own old
# value, scalar arguments and the random stream, so a slice can be computed alone.
ELEMENTWISE = {
    aten.normal_.default, aten.uniform_.default, aten.fill_.Scalar, aten.fill_.Tensor,
    aten.zero_.default, aten.mul_.Scalar, aten.mul_.Tensor, aten.add_.Scalar,
    aten.add_.Tensor, aten.sub_.Tensor, aten.div_.Scalar, aten.div_.Tensor,
    aten.clamp_.default, aten.erfinv_.default, aten.exp_.default, aten.log_.default,
    aten.neg_.default, aten.bernoulli_.float, aten.copy_.default,
}  # fmt: skip


@dataclass(frozen=True)
class Write:
    """One recorded operation: `op(target, *args)` on the view of a parameter with
    `size`, `stride` and `offset` (elements from the parameter's first)."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def covers(self, shape: torch.Size) -> bool:
        """Whether the view is the whole (contiguous) parameter."""
        return self.offset == 0 and self.size == tuple(shape) and self.stride == contiguous(shape)

    def indices(self) -> torch.Tensor:
        """The flat positions in the parameter of the view's elements, in its order."""
        index = torch.full((), self.offset, dtype=torch.int64)
        for size, stride in zip(self.size, self.stride, strict=True):
            index = index.unsqueeze(-1) + torch.arange(size) * stride
        return index.reshape(-1)


def contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    """Records the writes to meta parameters; runs everything else as it is."""

    def __init__(self, params: dict[int, tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.params = params
        self.writes: dict[str, list[Write]] = {name: [] for name, _ in params.values()}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        touched = [
            a for a in args if isinstance(a, torch.Tensor) and a.device.type == "meta"
            and storage_key(a) in self.params
        ]  # fmt: skip
        if touched and not func.is_view and func not in (aten.detach.default, aten.alias.default):
            target = args[0]
            tracked = storage_key(target) in self.params
            if func not in ELEMENTWISE or not tracked or any(a is not target for a in touched):
                who = self.params[storage_key(touched[0])][0]
                raise NotImplementedError(
                    f"the init of {who} on the meta device runs {func}, which is not an "
                    "elementwise in-place operation, so a shard cannot be drawn alone; "
                    "build this model on a real device, or give its weights (a state dict)"
                )
            rest = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args[1:])
            self.record(target, func, rest, kwargs)
        return func(*args, **kwargs)

    def record(self, target: torch.Tensor, op: Any, args: tuple, kwargs: dict) -> bool:
        """Record `op(target, *args, **kwargs)` if `target` is (a view of) a parameter."""
        entry = self.params.get(storage_key(target)) if target.device.type == "meta" else None
        if entry is None:
            return False
        name, param = entry
        offset = target.storage_offset() - param.storage_offset()
        self.writes[name].append(
            Write(op, args, kwargs, tuple(target.shape), tuple(target.stride()), offset)
        )
        return True


@contextlib.contextmanager
def recording_trunc_normal(recorder: _Recorder) -> Iterator[None]:
    """torch's trunc_normal_ returns at once on a meta tensor (no operation reaches the
    dispatcher) and draws by rejection, so it is recorded whole: its truncated normal is
    elementwise too, and replayed on a slice draws just that slice. Every caller (torch's
    nn.init, Hugging Face's init wrappers) reaches it through this module attribute."""
    original = torch.nn.init._no_grad_trunc_normal_

    def trunc_normal(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not recorder.record(tensor, original, args, kwargs):
            original(tensor, *args, **kwargs)
        return tensor

    torch.nn.init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = original


def own_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """How the model initialises one module: a Hugging Face model's `_init_weights`,
    else the module's own `reset_parameters` (torch's layers)."""
    init_weights = getattr(model, "_init_weights", None)
    if callable(init_weights):
        return init_weights

    def reset(module: nn.Module) -> None:
        reset_parameters = getattr(module, "reset_parameters", None)
        if callable(reset_parameters):
            reset_parameters()

    return reset


class MetaInit:
    """The initial values of a meta model's parameters, drawn a slice at a time."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        init: Callable[[nn.Module], None] | None = None,
        require_all: bool = True,
    ) -> None:
        """`require_all=False` when the parameters' values come from elsewhere (a state
        dict): the init then only has to fill the buffers."""
        params = {
            storage_key(p): (name, p)
            for name, p in model.named_parameters()
            if p.device.type == "meta"
        }
        self.shapes = {name: p.shape for name, p in params.values()}
        self.dtypes = {name: p.dtype for name, p in params.values()}
        meta_buffers = materialise_buffers(model, device)
        recorder = _Recorder(params)
        init = init or own_init(model)
        with torch.no_grad(), recorder, recording_trunc_normal(recorder):
            for module in model.modules():
                init(module)
        self.writes = recorder.writes
        self.drawn = 0  # elements computed so far, for the tests' count
        missing = [name for name, writes in self.writes.items() if not writes]
        if missing and require_all:
            raise ValueError(
                f"parameter {missing[0]} is on the meta device and the model's init "
                f"({getattr(init, '__qualname__', init)}) never writes it, so it has no "
                "value; give the module a reset_parameters, or build the model on a real device"
            )
        del meta_buffers

    def initial_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of parameter `name`, flattened, as its init makes them."""
        out = torch.zeros(end - start, dtype=self.dtypes[name])
        for write in self.writes[name]:
            if write.covers(self.shapes[name]):  # the whole parameter: just this slice of it
                write.op(out, *sliced(write.args, self.shapes[name], start, end), **write.kwargs)
                continue
            # A part (e.g. one row): computed whole, the slice's elements kept.
            where = write.indices()
            inside = (where >= start) & (where < end)
            if not bool(inside.any()):
                continue
            part = torch.zeros(where.numel(), dtype=out.dtype)
            part[inside] = out[where[inside] - start]
            write.op(part.view(write.size), *write.args, **write.kwargs)
            out[where[inside] - start] = part[inside]
        self.drawn += end - start
        return out

    def initial_value(self, name: str) -> torch.Tensor:
        return self.initial_values(name, 0, self.shapes[name].numel()).view(self.shapes[name])


def sliced(args: tuple[Any, ...], shape: torch.Size, start: int, end: int) -> tuple[Any, ...]:
    """An operation's arguments for elements [start, end) of a parameter of `shape`: a
    tensor of the parameter's shape (a `copy_`'s source) sliced the same way."""
    return tuple(
        a.reshape(-1)[start:end] if isinstance(a, torch.Tensor) and a.shape == shape else a
        for a in args
    )


def materialise_buffers(model: nn.Module, device: torch.device) -> list[str]:
    """Every meta buffer allocated (empty) on `device`, for the init to fill; their names."""
    names = []
    for module_name, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[key] = torch.empty_like(buffer, device=device)
                names.append(f"{module_name}.{key}" if module_name else key)
    return names
