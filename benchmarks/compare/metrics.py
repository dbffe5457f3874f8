"""The measuring instruments every system's job uses the same way (see common.py for what
each column means): collectives counted at torch's dispatcher, floating-point tensor bytes
alive in Python, and the process's resident memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
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
#
# Two figures per rank, each taken the same way for every system:
# - the peak during the timed steps, above the process's own baseline (PeakMeter): the
#   resident set (VmRSS / VmHWM) on CPU, the caching allocator's allocated bytes on CUDA;
# - the model states and the other tensors alive at the end of a warm-up step's backward
#   (live_tensor_bytes): storages found by walking Python's objects, sized by us, never a
#   system's own byte count. Which tensors are gradients or optimizer states of a system
#   that keeps them outside `.grad` and torch's optimizer state (our engine's flat shards,
#   DeepSpeed's gradient partitions) its adapter names (Trainer.tensor_roles); what it
#   preallocates for communication (DeepSpeed's reduce buckets) too, reported apart.

ROLES = ("parameters", "gradients", "optimizer", "buffers")
MODEL_STATES = ("parameters", "gradients", "optimizer")


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


def _addresses(tensors: Any) -> set[int]:
    return {s[0] for t in tensors if isinstance(t, torch.Tensor) and (s := _storage(t))}


def live_tensor_bytes(
    roles: dict[str, list[torch.Tensor]], exclude: list[torch.Tensor]
) -> dict[str, int]:
    """Bytes of every floating-point tensor storage alive in Python, each storage once, by
    role: `parameters`, `gradients`, `optimizer` (model states), `buffers` (what a system
    preallocates for communication), `other` (everything else alive, e.g. gradient
    buckets); `model_states` is the sum of the first three. A storage's role is the first
    that claims it, in that order: the tensors `roles` names, plus, for every system, the
    `.grad` of those parameters, and the state and master copies (parameters that are not
    the model's) of every torch optimizer alive. Tensors held only by C++ (DDP's reducer
    buckets, autograd's saved tensors) are not seen here; the peak RSS sees them."""
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

    params = _addresses(roles.get("parameters", []))
    parameters = roles.get("parameters", [])
    grads = _addresses(roles.get("gradients", [])) | _addresses(
        getattr(t, "grad", None) for t in parameters
    )
    optim = _addresses(roles.get("optimizer", []))
    for optimizer in optimizers:
        for state in optimizer.state.values():
            optim |= _addresses(v for v in state.values() if isinstance(v, torch.Tensor))
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        optim |= _addresses(owned) - params
        grads |= _addresses(getattr(p, "grad", None) for p in owned)
    claimed = [
        ("parameters", params),
        ("gradients", grads),
        ("optimizer", optim),
        ("buffers", _addresses(roles.get("buffers", []))),
    ]
    skip = _addresses(exclude)
    totals = dict.fromkeys((*ROLES, "other"), 0)
    for address, nbytes in storages.items():
        if address in skip:
            continue
        kind = next((name for name, owned in claimed if address in owned), "other")
        totals[kind] += nbytes
    totals["model_states"] = sum(totals[k] for k in MODEL_STATES)
    totals["total"] = sum(totals[k] for k in (*ROLES, "other"))
    return totals


def settled_tensor_bytes(
    roles: dict[str, list[torch.Tensor]], exclude: list[torch.Tensor], samples: int = 4
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
        taken.append(live_tensor_bytes(roles, exclude))
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


def release_free_heap() -> bool:
    """Collect garbage and hand the allocator's free pages back to the kernel (glibc's
    malloc_trim), so that the resident set is what is alive, not what malloc kept of
    earlier frees (a benchmark's set-up frees a full copy of the weights in some systems
    and not in others). False where there is no glibc."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)  # returns whether it released anything; either is fine
        return True
    except (OSError, AttributeError):
        return False


class PeakMeter:
    """Peak memory of this process over a window, above its own baseline; the same
    instrument for every system:

        meter = PeakMeter(device)   # after imports and process-group start, before the model
        ...build the system, warm up...
        meter.start()               # just before the timed steps: the peak is reset here
        ...timed steps...
        figures = meter.stop()      # peak during the window, above the baseline

    On CPU the figure is the process's own resident memory: VmHWM after the window
    (writing 5 to /proc/self/clear_refs resets it to VmRSS just before the window) minus
    VmRSS at the baseline, less the file-backed pages (RssFile: library code that the
    first steps page in, torch's own; it stays flat over the timed steps, and its value at
    the window's start is the one taken, so the figure can only err upwards). Baseline
    and start follow a garbage collection and malloc_trim, so neither counts pages malloc
    kept of earlier frees. On CUDA the figure is torch.cuda.max_memory_allocated over the
    window (reset by reset_peak_memory_stats) minus memory_allocated at the baseline; the
    RSS figures are kept beside it. Everything the system holds during the window counts
    (model states, buffers, activations, transients, what only C++ holds), nothing of the
    interpreter, torch or the system's import."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.trimmed = release_free_heap()
        self.baseline_rss = current_rss()
        self.baseline_file = _proc_status("RssFile") or 0
        self.baseline_device = self._allocated()
        self.windowed = False
        self.start_rss = self.start_file = 0

    def _allocated(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def start(self) -> None:
        release_free_heap()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.start_rss = current_rss()
        self.start_file = _proc_status("RssFile") or 0
        self.windowed = reset_peak_rss()

    def stop(self) -> dict[str, Any]:
        peak = peak_rss()
        stop_file = _proc_status("RssFile") or 0
        figures: dict[str, Any] = {
            "baseline_rss": self.baseline_rss,
            "start_rss": self.start_rss,
            "peak_rss": peak,
            "rss_file": [self.baseline_file, self.start_file, stop_file],
            "peak_rss_above_baseline": (peak - self.start_file)
            - (self.baseline_rss - self.baseline_file),
            # False where the high-water mark could not be reset: then it is the
            # lifetime's, set-up included, and the report does not use it.
            "windowed": self.windowed,
            "malloc_trim": self.trimmed,
        }
        if self.cuda:
            torch.cuda.synchronize(self.device)
            device_peak = torch.cuda.max_memory_allocated(self.device)
            figures.update(
                baseline_device=self.baseline_device,
                peak_device=device_peak,
                peak_device_above_baseline=device_peak - (self.baseline_device or 0),
            )
        figures["peak_above_baseline"] = figures[
            "peak_device_above_baseline" if self.cuda else "peak_rss_above_baseline"
        ]
        return figures


# ---- the machine ----------------------------------------------------------------------------
