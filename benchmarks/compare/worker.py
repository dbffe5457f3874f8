"""One benchmark job, on every rank of a torchrun launch:

    torchrun --standalone --nproc_per_node N -m benchmarks.compare.worker \\
        --spec '<JobSpec JSON>' --out DIR

reads this process's memory baseline (after imports and process-group start), builds the
system of the spec, trains it on the shared batches (common.train, which takes the peak
over the timed steps) and writes DIR/rank<R>.json with its losses, step times,
communication, model states and peak memory above the baseline.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path

import torch

from hybrid.distributed.env import init_distributed, shutdown

from .breakdown import breakdown_step, rss_by_phase
from .common import JobSpec, global_batches, load_lazy_imports, local_batch, machine, train
from .metrics import PeakMeter

# system -> (module, trainer class); imported on demand so that only DeepSpeed's own jobs
# import DeepSpeed (its import alone costs seconds and memory).
RUNNERS = {
    "ours": ("peers.ours", "OursTrainer"),
    "plain": ("peers.plain", "PlainTrainer"),
    "floor": ("peers.plain", "PlainTrainer"),
    "ddp": ("peers.torch_peers", "TorchTrainer"),
    "fsdp2": ("peers.torch_peers", "TorchTrainer"),
    "dtensor_tp": ("peers.torch_peers", "TorchTrainer"),
    "fsdp2_tp": ("peers.torch_peers", "TorchTrainer"),
    "deepspeed": ("peers.deepspeed_peer", "DeepSpeedTrainer"),
}


def trainer_class_of(system: str) -> type:
    """The trainer class of `system`, importing only its own module."""
    module_name, class_name = RUNNERS[system]
    return getattr(importlib.import_module(f"{__package__}.{module_name}"), class_name)


def run(spec: JobSpec, out: Path, breakdown: bool = False) -> dict:
    # torchrun gives every local rank OMP_NUM_THREADS=1 when it starts several; the driver
    # sets it for one-process jobs too, so every rank computes on one thread.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trainer_class = trainer_class_of(spec.system)
    env = init_distributed()
    if env.world_size != spec.world:
        raise ValueError(f"launched {env.world_size} processes for a job of {spec.world}")
    try:
        torch.manual_seed(0)
        device = env.device if spec.bench.device == "cuda" else torch.device("cpu")
        global_ = global_batches(spec.bench)  # the harness's data (KBs), before the baseline
        load_lazy_imports(device)
        # Everything is imported (the system's module above, what torch imports on first
        # use) and the process group is up: what the process holds from here on is the
        # system's.
        meter = PeakMeter(device)
        tick = time.perf_counter()
        trainer = trainer_class(spec, device)
        setup_s = time.perf_counter() - tick
        batches = [
            tuple(t.to(device) for t in local_batch(b, trainer.dp_rank, spec.dp)) for b in global_
        ]
        result = train(trainer, batches, spec.bench.warmup, meter)
        if breakdown:  # after the measured window: the tracker slows every operation
            result["rss_phases"] = rss_by_phase(trainer, *batches[-1], meter)
            result["breakdown"] = breakdown_step(trainer, *batches[-1])
        result.update(
            spec=json.loads(spec.to_json()),
            rank=env.rank,
            dp_rank=trainer.dp_rank,
            tp_rank=trainer.tp_rank,
            setup_s=setup_s,
            reported=trainer.reported(),
            machine=machine(),
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1))
        return result
    finally:
        shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a JobSpec as JSON")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<R>.json")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="then one more step under MemTracker: the peak by category and phase",
    )
    args = parser.parse_args()
    run(JobSpec.from_json(args.spec), args.out, args.breakdown)


if __name__ == "__main__":
    main()
