"""Where one step's memory goes, for any system: torch's MemTracker (an instrument none of
the systems is), the peak by category and by phase (forward, backward, optimizer step).

MemTracker files each storage by when it was made ("Activation" in forward, "Temp" in
backward) or by what it is when it knows (a module's parameters, `.grad`, an optimizer's
states). A system that keeps its gradients or masters outside `.grad` and torch's
optimizer (our engine's flat shards, DeepSpeed's partitions) would then have them filed
by accident of timing; so, whenever the total reaches a new high, every storage the
system's adapter names (`Trainer.tensor_roles`, the same lists the model-state count
uses) is filed under its role first, for every system alike:

    parameters    a module's parameters and the storages the adapter names as such
    gradients     `.grad` of those parameters and the adapter's gradient tensors
    optimizer     torch's optimizer states and the adapter's masters and moments
    activations   made in forward and kept (what autograd saves)
    temporaries   made in backward or the step and not claimed above (autograd's
                  working tensors, gradient buckets being filled or reduced)
    other         module buffers and what the adapter names as communication buffers

The bytes are MemTracker's; only the labels come from the adapter's references.
Tensors only C++ holds (DDP's reducer buckets, a backend's staging copies) are not seen
here; the peak RSS of the same job sees them (metrics.PeakMeter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "other")
PHASES = ("forward", "backward", "step")
_TOTAL = "Total"
_FROM = {  # MemTracker's reference types -> our categories
    _MemRefType.PARAM: "parameters",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.BUFFER: "other",
    _MemRefType.OTH: "other",
}
_ROLE = {
    "parameters": _MemRefType.PARAM,
    "gradients": _MemRefType.GRAD,
    "optimizer": _MemRefType.OPT,
    "buffers": _MemRefType.OTH,
}


def role_tensors(
    roles: dict[str, list[torch.Tensor]], optimizers: list[torch.optim.Optimizer]
) -> Iterator[tuple[Any, torch.Tensor]]:
    """(MemTracker reference type, tensor) for every tensor a system names by role, the
    `.grad` of its parameters and its optimizers' states. Where two share a storage (in
    fp32 our master is the parameter shard) the later wins, and the order is the model-state
    count's (metrics.live_tensor_bytes): parameters over gradients over optimizer states."""
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield _MemRefType.OPT, value
    for role in ("buffers", "optimizer", "gradients"):
        for tensor in roles.get(role, []):
            if isinstance(tensor, torch.Tensor):
                yield _ROLE[role], tensor
    for tensor in roles.get("parameters", []):
        if isinstance(tensor, torch.Tensor) and tensor.grad is not None:
            yield _MemRefType.GRAD, tensor.grad
    for tensor in roles.get("parameters", []):
        if isinstance(tensor, torch.Tensor):
            yield _MemRefType.PARAM, tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "_local_tensor", None)  # a DTensor's shard is what is held
    return local if isinstance(local, torch.Tensor) else tensor


class PhaseMemoryTracker(MemTracker):
    """MemTracker with the peak kept per phase and the named tensors filed by role:

    tracker = PhaseMemoryTracker(lambda: role_tensors(trainer.tensor_roles(), opts))
    tracker.track_external(module, *optimizers)
    with tracker:
        with tracker.phase("forward"): loss = trainer.forward(x, y)
        with tracker.phase("backward"): trainer.backward(loss)
        with tracker.phase("step"): trainer.optimizer_step()
    tracker.report()  # {"peak": {...}, "phases": {"forward": {...}, ...}}
    """

    def __init__(self, labels: Callable[[], Iterator[tuple[Any, torch.Tensor]]]) -> None:
        super().__init__()
        self._labels = labels
        self._phase: str | None = None
        self.phase_peaks: dict[str, dict[str, int]] = {}

    def label(self) -> None:
        for reftype, tensor in self._labels():
            local = _local(tensor)
            if local.device.type != "meta" and local.untyped_storage().nbytes():
                self._update_and_maybe_create_winfos(local, reftype)

    def _total(self) -> int:
        return sum(snap[_TOTAL] for snap in self._curr_mem_snap.values())

    def _by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for snap in self._curr_mem_snap.values():
            for key, value in snap.items():
                if key != _TOTAL:
                    out[_FROM[key]] += int(value)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out

    def _note(self) -> None:
        """Keep the current snapshot as the phase's peak if it is a new high."""
        if self._phase is None:
            return
        best = self.phase_peaks.get(self._phase)
        if best is None or self._total() > best["total"]:
            self.label()
            self.phase_peaks[self._phase] = self._by_category()

    def _update_peak_stats(self, peak_state) -> None:  # type: ignore[no-untyped-def]
        self._note()
        super()._update_peak_stats(peak_state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._note()  # every allocation, not only those at a module's boundary
        return out

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase = name
        self.phase_peaks.pop(name, None)
        self._note()  # what the phase starts with
        try:
            yield
        finally:
            self._note()
            self._phase = None

    def report(self) -> dict[str, Any]:
        phases = {name: self.phase_peaks[name] for name in PHASES if name in self.phase_peaks}
        peak_phase = max(phases, key=lambda name: phases[name]["total"])
        return {"peak": {**phases[peak_phase], "phase": peak_phase}, "phases": phases}


def rss_by_phase(trainer: Any, x: torch.Tensor, y: torch.Tensor, meter: Any) -> dict[str, int]:
    """One more step with the kernel's high-water mark reset before each phase: the peak
    RSS above the job's baseline (metrics.PeakMeter's rule) in forward, backward and the
    step, no tracker running. Where RSS and MemTracker disagree, this says in which phase
    the bytes no tracker sees (C++-held, the allocator's) are."""
    from .metrics import _proc_status, peak_rss, reset_peak_rss

    base = meter.baseline_rss - meter.baseline_file
    out: dict[str, int] = {}

    def measured(name: str, run: Callable[[], Any]) -> Any:
        reset_peak_rss()
        value = run()
        out[name] = peak_rss() - (_proc_status("RssFile") or 0) - base
        return value

    held: list[torch.Tensor] = [measured("forward", lambda: trainer.forward(x, y))]
    measured("backward", lambda: trainer.backward(held.pop()))
    measured("step", trainer.optimizer_step)
    return out


def optimizers_of(owner: Any, depth: int = 3) -> list[torch.optim.Optimizer]:
    """The torch optimizers an adapter holds: in its attributes, and theirs (DeepSpeed's
    ZeRO optimizer wraps torch's), a few levels deep; each once."""
    found: dict[int, torch.optim.Optimizer] = {}

    def walk(value: Any, level: int) -> None:
        if isinstance(value, torch.optim.Optimizer):
            found.setdefault(id(value), value)
        if level == 0 or isinstance(value, (torch.Tensor, torch.nn.Module)):
            return
        for name in ("optimizer", "engine", "_optimizer"):
            inner = getattr(value, name, None)
            if inner is not None and inner is not value:
                walk(inner, level - 1)

    walk(owner, depth)
    return list(found.values())


def breakdown_step(trainer: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One more training step of `trainer` under the tracker: the peak by category, per
    phase and overall (bytes). Run after the timed steps: the tracker's dispatch mode slows
    every operation, so it must not be inside a timed or RSS-measured window."""
    import gc
    import warnings

    gc.collect()
    optimizers = optimizers_of(trainer)
    modules = [m for m in vars(trainer).values() if isinstance(m, torch.nn.Module)]
    engine = getattr(trainer, "engine", None)
    if isinstance(getattr(engine, "module", None), torch.nn.Module):
        modules.append(engine.module)
    tracker = PhaseMemoryTracker(lambda: role_tensors(trainer.tensor_roles(), optimizers))
    tracker.track_external(*modules, *optimizers)
    tracker.label()
    with tracker, warnings.catch_warnings():
        # MemTracker's gradient hooks warn on parameters without a gradient: harmless.
        warnings.filterwarnings("ignore", "Expected a tensor", UserWarning)
        with tracker.phase("forward"):
            loss = trainer.forward(x, y)
        with tracker.phase("backward"):
            trainer.backward(loss)
            del loss
        with tracker.phase("step"):
            trainer.optimizer_step()
    return tracker.report()
