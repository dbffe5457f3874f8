"""The measuring instruments every system's job uses the same way (see common.py for what
each column means): collectives counted at torch's dispatcher, floating-point tensor bytes
alive in Python, and the process's resident memory.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ---- communication --------------------------------------------------------------------------


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


# operator name -> kind; the counted tensors are the first argument except where noted.
_KINDS = (
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("allgather", "all_gather"),  # c10d: the outputs, i.e. the gathered tensor
    ("all_gather", "all_gather"),  # functional: the input shard x group size
    ("reduce_scatter", "reduce_scatter"),  # the full input (c10d: second argument)
    ("broadcast", "broadcast"),
    ("alltoall", "all_to_all"),  # c10d: second argument, the input
    ("all_to_all", "all_to_all"),
)
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _counted_bytes(namespace: str, name: str, kind: str, args: tuple) -> int:
    def size(value: Any) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(value))

    if namespace == "c10d":
        return size(args[1] if kind in ("reduce_scatter", "all_to_all") else args[0])
    if kind == "all_gather":  # (input, group_size, group_name)
        return size(args[0]) * int(args[1])
    return size(args[0])


class CommCounter(TorchDispatchMode):
    """Counts the collectives issued on this thread (and on autograd's, which inherits the
    mode) at the dispatcher: the process-group operators (`c10d::`, which dist.*, DDP's C++
    reducer and FSDP2 reach) and the functional collectives (`_c10d_functional::`, DTensor's
    path). The latter call their process group directly, not through a `c10d::` operator,
    and a mode does not see what runs inside an operator it handles, so nothing is counted
    twice; `wait_tensor` and barriers are not collectives of data."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if func.namespace in _NAMESPACES:
            name = func._schema.name.split("::", 1)[1]
            for key, kind in _KINDS:
                if key in name:
                    self.bytes[kind] += _counted_bytes(func.namespace, name, kind, args)
                    self.calls[kind] += 1
                    break
            else:
                if not any(skip in name for skip in ("barrier", "wait", "wrap")):
                    self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        return {
            "bytes": dict(self.bytes),
            "calls": dict(self.calls),
            "total_bytes": sum(self.bytes.values()),
        }


# ---- memory ---------------------------------------------------------------------------------


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the storage behind a floating-point tensor (a DTensor's local
    shard); None for tensors without one (meta, wrapper subclasses) and for integer and
    byte tensors: model states are floating point, RNG states and indices are not."""
    try:
        local = getattr(tensor, "_local_tensor", None)
        tensor = local if isinstance(local, torch.Tensor) else tensor
        if tensor.device.type == "meta" or not tensor.is_floating_point():
            return None
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        return (address, storage.nbytes()) if address else None
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def live_tensor_bytes(
    model_tensors: list[torch.Tensor], exclude: list[torch.Tensor]
) -> dict[str, int]:
    """Bytes of every tensor storage alive in Python, each once: parameters (storages of
    `model_tensors`), gradients (their `.grad`), optimizer (state and master copies of every
    torch optimizer alive) and other (everything else, e.g. gradient buckets). Tensors held
    only by C++ (DDP's reducer buckets, autograd's saved tensors) are not seen."""
    gc.collect()
    objects = gc.get_objects()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on some library proxies warns; harmless
        warnings.simplefilter("ignore")
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    for tensor in tensors:
        found = _storage(tensor)
        if found:
            storages[found[0]] = found[1]

    def addresses(tensors: Any) -> set[int]:
        return {s[0] for t in tensors if t is not None and (s := _storage(t))}

    params = addresses(model_tensors)
    grads = addresses(getattr(t, "grad", None) for t in model_tensors)
    optim: set[int] = set()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            optim |= addresses(v for v in state.values() if isinstance(v, torch.Tensor))
        optim |= addresses(p for g in optimizer.param_groups for p in g["params"]) - params
    skip = addresses(exclude)
    totals = {"parameters": 0, "gradients": 0, "optimizer": 0, "other": 0}
    for address, nbytes in storages.items():
        if address in skip:
            continue
        kind = (
            "parameters"
            if address in params
            else "gradients"
            if address in grads
            else "optimizer"
            if address in optim
            else "other"
        )
        totals[kind] += nbytes
    totals["total"] = sum(totals.values())
    return totals


def settled_tensor_bytes(
    model_tensors: list[torch.Tensor], exclude: list[torch.Tensor], samples: int = 4
) -> dict[str, Any]:
    """`live_tensor_bytes`, the smallest of a few samples 20 ms apart. Under load, a single
    sample once counted a gradient bucket that had already been released (+12 MB for ours at
    stage 2 in one smoke run, +0.5 MB for FSDP2 in another; not reproduced on reruns). The
    likely cause: gloo's worker thread drops a finished collective's tensors a moment after
    `wait()` returns, and a tensor C++ still holds keeps its Python object. The samples are
    kept in the result, so such a transient shows."""
    taken = []
    for i in range(samples):
        if i:
            time.sleep(0.02)
        taken.append(live_tensor_bytes(model_tensors, exclude))
    least = min(taken, key=lambda m: m["total"])
    return {**least, "samples": [m["total"] for m in taken]}


def _proc_status(field_name: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return None


def current_rss() -> int:
    return _proc_status("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """VmHWM, or the lifetime peak where /proc is missing."""
    return _proc_status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the machine ----------------------------------------------------------------------------
