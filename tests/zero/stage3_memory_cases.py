"""Worker for tests/zero/test_stage3_memory.py: a ZeRO-3 step under torch's MemTracker.

The instrument is not the engine: MemTracker follows every storage created in its context
(and storage resizes), plus the live tensors handed to it before, found here through the
garbage collector rather than asked of the engine. Activations come from a second
instrument run of the same model at stage 0 in the same processes, where nothing is ever
gathered: the memory its forward adds, and its backward adds at peak.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

# Parameters dominate (a unit bucket is ~0.8 MB in fp32 against ~0.2 MB of activations per
# layer), so holding a bucket too many shows, and 6 layers against at most 3 buckets held.
CONFIG = GPTConfig(n_layer=6, n_head=4, d_model=128, seq_len=16, vocab_size=256)
CPU = torch.device("cpu")


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device == CPU]


def _measured_step(stage: int, tp: int, recompute: str) -> dict[str, Any]:
    """Peak bytes on this rank during the forward and the backward of a second step (the
    first creates Adam's state), with the layout's sizes for the bound."""
    topology = Topology.build(tp)
    parallel = TensorParallel.from_topology(topology, 0)
    policy = RecomputePolicy(Recompute(recompute))
    device = "meta" if stage == 3 else "cpu"
    model = GPT(CONFIG, parallel, policy, seed=0, device=device)
    engine = Engine(model, topology, parallel, EngineConfig(zero_stage=stage), list(model.blocks))
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1), generator=torch.Generator())
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step(1e-3)
    tracker = MemTracker()
    tracker.track_external(model, engine.optimizer, *_live_tensors())
    with tracker:
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    stats = tracker.memory_tracking[model]

    def total(state: _ModState) -> int:
        return stats.snapshots[state][-1][CPU]["Total"]

    def category(state: _ModState, name: str) -> int:
        return stats.snapshots[state][-1][CPU][_MemRefType(name)]

    out = {
        "before": total(_ModState.PRE_FW),
        "forward": total(_ModState.PEAK_FW),
        "backward": total(_ModState.PEAK_BW),
        "forward_params": category(_ModState.PEAK_FW, "Parameter"),
        "backward_params": category(_ModState.PEAK_BW, "Parameter"),
        "root": engine.buckets[0].numel * 4,
        "unit": max(b.numel for b in engine.buckets[1:]) * 4,
        "unit_shard": max(b.shard_numel for b in engine.buckets[1:]) * 4,
        "shard": sum(b.shard_numel for b in engine.buckets) * 4,
    }
    engine.step(1e-3)
    return out


def stage3_peaks(tp: int, mode: str) -> dict[str, dict[str, Any]]:
    """The stage-3 step, measured first in a fresh process (nothing else alive), then the
    stage-0 reference, of which only what its step adds is used (MemTracker's own gradient
    hooks keep the first model's parameters alive after it)."""

    def work() -> dict[str, dict[str, Any]]:
        return {"stage3": _measured_step(3, tp, mode), "stage0": _measured_step(0, tp, mode)}

    return in_process_group(work)
