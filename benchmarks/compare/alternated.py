"""One alternated timing job, on every rank of a torchrun launch:

    torchrun --standalone --nproc_per_node N -m benchmarks.compare.alternated \\
        --specs '[<JobSpec JSON>, ...]' --rounds R --block K --out FILE

builds every system of one layout in the same processes (each its own model from the
same initial weights, benchmarks/compare/peers), runs each through its warm-up, then R
rounds: in a round every system trains K consecutive steps (a block), the order rotated
by one system per round, so that each system runs first, second, ... equally often. A
block starts behind a barrier and ends once the system's work has ended on this rank
(ours' parameter gathers left in flight for the next forward: Engine.wait_for_parameters),
so no system's communication runs in another's time. Each block gives, per rank, the
wall time and the CPU time (time.process_time: every thread of this process, gloo's
included) and the minor page faults (the kernel's count: every fresh page a step touches)
per step. Rank 0 writes FILE with every rank's blocks and every system's losses.

Why one job: separate jobs differ by what no system controls (another tenant's burst that
lasts a job, process start, the page cache), which gave ranges of +-20-40% between rounds
of benchmarks/compare_systems.py here; inside one job the systems see the same machine
block by block, and the rotation removes the order effect (the system that runs after
another finds its caches, heap and page tables in the state the other left).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid.distributed.env import init_distributed, shutdown

from .common import JobSpec, forward_backward, global_batches, load_lazy_imports, local_batch
from .worker import trainer_class_of


def rotated(items: list, by: int) -> list:
    """`items` starting at position `by` (mod its length): round r's order."""
    k = by % len(items)
    return items[k:] + items[:k]


def settle(trainer: object) -> None:
    """End what a system leaves in flight after its step (ours at stages 1-2)."""
    engine = getattr(trainer, "engine", None)
    wait = getattr(engine, "wait_for_parameters", None)
    if callable(wait):
        wait()


def run(specs: list[JobSpec], rounds: int, block: int, out: Path) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    classes = [trainer_class_of(s.system) for s in specs]  # imports before anything runs
    env = init_distributed()
    try:
        bench = specs[0].bench
        if any(s.bench != bench or s.world != env.world_size for s in specs):
            raise ValueError("an alternated job's systems share one model, batch and world")
        device = env.device if bench.device == "cuda" else torch.device("cpu")
        load_lazy_imports(device)
        trainers, data = [], []
        for spec, cls in zip(specs, classes, strict=True):
            torch.manual_seed(0)
            trainer = cls(spec, device)
            trainers.append(trainer)
            batches = global_batches(bench)  # warm-up + rounds x block windows, same for all
            data.append(
                [
                    tuple(t.to(device) for t in local_batch(b, trainer.dp_rank, spec.dp))
                    for b in batches
                ]
            )
        if len(data[0]) < bench.warmup + rounds * block:
            raise ValueError("the bench config holds fewer batches than warm-up + rounds x block")
        losses: list[list[float]] = [[] for _ in specs]
        for i, trainer in enumerate(trainers):  # warm-up, untimed
            for x, y in data[i][: bench.warmup]:
                losses[i].append(float(forward_backward(trainer, x, y)))
                trainer.optimizer_step()
            settle(trainer)
        blocks: list[dict] = []  # one per (round, system): this rank's wall and CPU per step
        for r in range(rounds):
            start = bench.warmup + r * block
            for i in rotated(list(range(len(specs))), r):
                trainer = trainers[i]
                if dist.is_initialized():  # one process runs without a group
                    dist.barrier()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                tick, cpu_tick = time.perf_counter(), time.process_time()
                for x, y in data[i][start : start + block]:
                    loss = forward_backward(trainer, x, y)
                    trainer.optimizer_step()
                    losses[i].append(float(loss))  # reading the loss waits for the step
                settle(trainer)
                wall = (time.perf_counter() - tick) / block
                cpu = (time.process_time() - cpu_tick) / block
                faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / block
                blocks.append({"round": r, "system": i, "wall": wall, "cpu": cpu, "faults": faults})
        every_rank: list = [blocks] * env.world_size
        if dist.is_initialized():
            dist.all_gather_object(every_rank, blocks)
        if env.rank == 0:
            result = {
                "specs": [json.loads(s.to_json()) for s in specs],
                "rounds": rounds,
                "block": block,
                "blocks": every_rank,  # [rank][block]
                "losses": losses,
            }
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result))
    finally:
        shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", required=True, help="a JSON list of JobSpec JSONs")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--block", type=int, required=True, help="consecutive steps per system")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    specs = [JobSpec.from_json(s) for s in json.loads(args.specs)]
    run(specs, args.rounds, args.block, args.out)


if __name__ == "__main__":
    main()
