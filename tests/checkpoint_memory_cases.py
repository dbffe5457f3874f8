"""Worker for tests/test_checkpoint_memory.py: a sharded save under torch's MemTracker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from tp_cases import in_process_group

from hybrid.checkpoint import save_checkpoint
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from hybrid.topology import Topology
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=64, seq_len=16, vocab_size=256)


def save_peak(root: str) -> dict[str, Any]:
    """What a stage-2 save adds to this rank's memory at its peak, and the sizes of what
    it writes (fp32 master and Adam's moments: this rank's shard of each)."""

    def work() -> dict[str, Any]:
        topology = Topology.build(1)
        parallel = TensorParallel.from_topology(topology, 0)
        model = GPT(CONFIG, parallel, seed=0, device="meta")
        engine = Engine(model, topology, parallel, EngineConfig(zero_stage=2), list(model.blocks))
        tracker = MemTracker()
        tracker.track_external(model, engine.optimizer, *[s.param_storage for s in engine.states])
        with tracker:
            before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
            save_checkpoint(engine, Path(root), 1, {"step": 1}, {}, keep=1)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        largest = max(shape.numel() for b in engine.buckets for shape in b.shapes)
        return {
            "added": peak - before,
            "written": 3 * 4 * sum(b.shard_numel for b in engine.buckets),
            "largest_parameter": 4 * largest,
        }

    return in_process_group(work)
