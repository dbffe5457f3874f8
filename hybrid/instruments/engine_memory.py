"""Memory by ZeRO's categories, measured by torch's MemTracker (an instrument outside the
engine), for one rank's Engine.

MemTracker sees every tensor torch allocates (its storages, also their resizing to 0 and
back at stage 3) and files each under a category by *when* it was made: "Parameter" for a
module's parameters, "Optstate" for an optimizer's states, "Activation" in forward,
"Temp" in backward. The engine's own tensors would then land by accident of timing (the
fp32 master under "Activation", a reduced gradient shard under "Temp"). So whenever the
total reaches a new high, before MemTracker copies its snapshot of the peak, every storage
the engine holds is filed under what it is, by identity:

    parameters   the low-precision parameters: flat buffers (stages 0-2), the shard and
                 the buckets gathered now (stage 3)
    gradients    the gradients kept for the step: stage 0's full buffer, stage 1's
                 between micro-batches, the reduced shards (stages 1-3)
    optimizer    the fp32 master (when it is not the parameter itself) and Adam's states
    buffers      transient communication buffers: gradient buckets being filled or
                 reduced, reductions in flight, the step's fp32 gradients
    activations  everything else: what autograd saves and its temporaries in backward,
                 autograd's own `param.grad` before the engine's hook takes it

The bytes are MemTracker's; only the labels come from the engine's references.
"""

from __future__ import annotations

from collections.abc import Iterator
from copy import deepcopy

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from hybrid.engine import Engine

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
_TOTAL = "Total"
# Our categories in MemTracker's reference types ("Other" holds the engine's buffers).
_AS = {
    "parameters": _MemRefType.PARAM,
    "gradients": _MemRefType.GRAD,
    "optimizer": _MemRefType.OPT,
    "buffers": _MemRefType.OTH,
    "activations": _MemRefType.TEMP,
}


def engine_tensors(engine: Engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(category, tensor) for every tensor the engine holds now. Later entries win where
    two share a storage (stage 0 in fp32 steps on the gradient buffer itself)."""
    for p in engine.module.parameters():
        if p.grad is not None:  # the step's gradients where the engine keeps autograd's
            yield ("gradients" if engine.autograd_grads else "activations"), p.grad
    for _, _, out, flat in engine._pending:
        yield "buffers", out
        yield "buffers", flat
    for state in engine.states:
        for _, view in state.master_segments:
            if view.grad is not None:
                yield "buffers", view.grad
        if state.grad_flat is not None:
            yield ("gradients" if _accumulates(engine) else "buffers"), state.grad_flat
        if state.grad_shard is not None:
            yield "gradients", state.grad_shard
        for moment in (state.exp_avg, state.exp_avg_sq):
            if moment is not None:
                yield "optimizer", moment
        if state.master is not state.param_shard:
            yield "optimizer", state.master
        yield "parameters", state.param_shard
        if state.param_flat is not None:
            yield "parameters", state.param_flat
    for step_state in engine.optimizer.state.values():
        yield "optimizer", step_state["step"]
    if engine.gatherer is not None:
        for flat in engine.gatherer._flat:
            yield "parameters", flat


def _accumulates(engine: Engine) -> bool:
    """Whether the full gradient buffers hold the step's gradients now (stage 0 always;
    stage 1 between the micro-batches, until its last backward reduces them) rather than
    being transient buckets (stages 2-3, and stage 1's reducing backward): the planner's
    convention (hybrid.memory.peak)."""
    return engine.stage == 0 or (engine.stage == 1 and not engine._reduces_now())


class EngineMemoryTracker(MemTracker):
    """MemTracker with the engine's storages filed by category at every new peak.

    tracker = EngineMemoryTracker()
    with tracker:
        model = GPT(...); engine = Engine(model, ...)
    tracker.follow(engine)
    with tracker:
        ...  # a training step
    tracker.categories("peak")  # {"parameters": ..., ..., "total": ...}
    """

    def __init__(self, module_peaks: bool = True) -> None:
        """`module_peaks=False`: only the whole rank's peak is kept, not each module's.
        MemTracker updates every module's peak at every op, a cost that grows with the
        model (16 layers of a 17B rank: 17 of a fake step's 30 s); a rehearsal reads only
        the rank's."""
        super().__init__()
        self.engine: Engine | None = None
        self.module_peaks = module_peaks

    def follow(self, engine: Engine) -> None:
        """Track the engine's model and optimizer (built under this tracker or not)."""
        self.engine = engine
        self.track_external(engine.module, engine.optimizer)
        self.label()

    def label(self) -> None:
        if self.engine is None:
            return
        for category, tensor in engine_tensors(self.engine):
            self._update_and_maybe_create_winfos(tensor, _AS[category])

    def _update_peak_stats(self, peak_state) -> None:  # type: ignore[no-untyped-def]
        # Only a new high is copied as the peak: label just before it is.
        for device, snap in self._curr_mem_snap.items():
            if snap[_TOTAL] > self._peak_mem.get(device, 0):
                self.label()
                break
        if self.module_peaks:
            super()._update_peak_stats(peak_state)
            return
        for device, snap in self._curr_mem_snap.items():  # MemTracker's own, for the rank
            if snap[_TOTAL] > self._peak_mem.get(device, 0):
                self._peak_mem[device] = snap[_TOTAL]
                self._peak_mem_snap[device] = deepcopy(snap)

    def categories(self, kind: str = "peak") -> dict[str, int]:
        """Bytes by category and "total" at the peak (or now: kind="current") on the
        engine's device."""
        if kind == "current":
            self.label()
        snapshots = self.get_tracker_snapshot(kind)
        device = self.engine.device if self.engine is not None else None
        # On a GPU the host holds a little too (token ids, RNG states): the engine's device.
        snap = snapshots.get(device) if device is not None else None
        if snap is None and len(snapshots) == 1:
            (snap,) = snapshots.values()
        if snap is None:
            return dict.fromkeys((*CATEGORIES, "total"), 0)
        by_type = {getattr(key, "value", key): int(value) for key, value in snap.items()}
        out = {name: by_type[ref.value] for name, ref in _AS.items() if name != "activations"}
        out["activations"] = sum(
            by_type[t.value] for t in (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.BUFFER)
        )
        out["total"] = by_type[_TOTAL]
        return {name: out[name] for name in (*CATEGORIES, "total")}
