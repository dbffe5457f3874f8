"""Worker for tests/checkpoint/test_checkpoint_memory.py: a sharded save, measured by the kernel's
peak RSS (VmHWM, reset just before). Not MemTracker: a tensor over a slice of an existing
storage is a new storage object to it, so it counts the memory again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tp_cases import in_process_group

from hybrid.checkpoint.engine_state import save_engine
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=512, seq_len=16, vocab_size=256)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def save_peak(root: str) -> dict[str, Any]:
    """What a stage-2 save of the engine's tensors adds to this rank's memory at its
    peak, and the size of what it writes (fp32 master and Adam's moments: this rank's
    shard of each)."""

    def work() -> dict[str, Any]:
        topology = Topology.build(1)
        parallel = TensorParallel.from_topology(topology, 0)
        model = GPT(CONFIG, parallel, seed=0, device="meta")
        engine = Engine(model, topology, parallel, EngineConfig(zero_stage=2), list(model.blocks))
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # VmHWM := VmRSS
        before = _status("VmHWM")
        save_engine(engine, Path(root))  # the tensors' part of save_checkpoint
        peak = _status("VmHWM")
        largest = max(shape.numel() for b in engine.buckets for shape in b.shapes)
        return {
            "added": peak - before,
            "written": 3 * 4 * sum(b.shard_numel for b in engine.buckets),
            "largest_parameter": 4 * largest,
        }

    return in_process_group(work)
