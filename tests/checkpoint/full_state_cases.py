"""Worker for tests/checkpoint/test_full_state.py: the end-of-run weights streamed from a ZeRO-3
engine into one safetensors file, under torch's MemTracker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from tp_cases import in_process_group

from hybrid.checkpoint.full_state import full_tensor_layout, write_safetensors
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=6, n_head=4, d_model=64, seq_len=16, vocab_size=256)
SEED = 7


def stream_weights(tp: int, path: str) -> dict[str, Any]:
    """Rank 0 writes the file while every rank walks the stream; returns what the write
    added to this rank's memory at its peak and the sizes it is compared with."""

    def work() -> dict[str, Any]:
        topology = Topology.build(tp)
        parallel = TensorParallel.from_topology(topology, SEED)
        model = GPT(CONFIG, parallel, seed=SEED, device="meta")
        engine = Engine(model, topology, parallel, EngineConfig(zero_stage=3), list(model.blocks))
        tracker = MemTracker()
        tracker.track_external(model, *[s.param_shard for s in engine.states])
        with tracker:
            before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
            if topology.rank == 0:
                write_safetensors(Path(path), full_tensor_layout(engine), engine.full_tensors())
            else:
                for _ in engine.full_tensors():
                    pass
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return {
            "added": peak - before,
            "bucket": max(b.numel for b in engine.buckets) * 4,
            # The largest parameter in its tp=1 shape (a TP-split one is tp local slices).
            "parameter": max(s.numel() for b in engine.buckets for s in b.shapes) * 4 * tp,
            "model": sum(b.numel for b in engine.buckets) * 4,
        }

    return in_process_group(work)
