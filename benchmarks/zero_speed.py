"""Step time of ZeRO stages 0-3 at dp=2 against stage 0 and torch DDP, on the demo model.

    python benchmarks/zero_speed.py [--rounds 3 --steps 30]

The model and batch are the CPU demo's (configs/tiny.yaml: 4 layers, d_model 128, seq 128,
vocab 512, global batch 16 = 2 ranks x 1 micro-batch of 8, fp32, AdamW, clipping at 1.0).
This machine is shared and noisy, so the systems alternate step by step inside one 2-process
gloo job (each system with its own copy of the model: A B C D E A B C D E ...), each
system's step time is the median over its steps, and each round (a fresh job) gives the
ratio of every system to stage 0 measured side by side; the table reports the medians over
rounds. The last loss of every system is printed so that a faster wrong answer shows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from hybrid.distributed import init_distributed, shutdown
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from hybrid.testing import run_processes
from hybrid.topology import Topology
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=512)
MICRO, LR, CLIP, WEIGHT_DECAY, WARMUP = 8, 1e-3, 1.0, 0.1, 3
SYSTEMS = ["ddp", "stage0", "stage1", "stage2", "stage3"]


def batches(steps: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randint(0, CONFIG.vocab_size, (MICRO, CONFIG.seq_len + 1), generator=g)
        for _ in range(steps)
    ]


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def make_step(system: str, topology: Topology) -> tuple[Callable, torch.nn.Module]:
    tp = TensorParallel.from_topology(topology, seed=0)
    model = GPT(CONFIG, tp, seed=0)
    if system == "ddp":
        ddp = DistributedDataParallel(model)
        opt = adamw(model)

        def ddp_step(x: torch.Tensor) -> float:
            loss = ddp(x[:, :-1], x[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return ddp_step, model
    config = EngineConfig(zero_stage=int(system[-1]), grad_clip=CLIP, weight_decay=WEIGHT_DECAY)
    engine = Engine(model, topology, tp, config, units=list(model.blocks))

    def engine_step(x: torch.Tensor) -> float:
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step(LR)
        return loss.item()

    return engine_step, model


def job(systems: list[str], steps: int) -> dict[str, dict[str, float]]:
    """One round on every rank: the systems interleaved step by step."""
    torch.set_num_threads(1)  # what torchrun gives each of several local ranks
    env = init_distributed()
    try:
        topology = Topology.build(1)
        steppers = {s: make_step(s, topology)[0] for s in systems}
        times: dict[str, list[float]] = {s: [] for s in systems}
        losses: dict[str, float] = {}
        for i, x in enumerate(batches(WARMUP + steps, topology.dp_rank)):
            for system, step in steppers.items():
                tick = time.perf_counter()
                losses[system] = step(x)
                if i >= WARMUP:
                    times[system].append(time.perf_counter() - tick)
        return {s: {"time": statistics.median(times[s]), "loss": losses[s]} for s in systems}
    finally:
        shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "zero_speed.md")
    args = parser.parse_args()
    times: dict[str, list[float]] = {s: [] for s in args.systems}
    ratios: dict[str, list[float]] = {s: [] for s in args.systems}
    losses: dict[str, float] = {}
    reference = "stage0" if "stage0" in args.systems else args.systems[0]
    for r in range(args.rounds):
        result = run_processes(job, 2, args.systems, args.steps, timeout_s=900)[0]
        for system in args.systems:
            times[system].append(result[system]["time"])
            ratios[system].append(result[system]["time"] / result[reference]["time"])
            losses[system] = result[system]["loss"]
        print(
            f"round {r + 1}: " + " ".join(f"{s} {times[s][-1] * 1e3:.1f}ms" for s in args.systems),
            flush=True,
        )
    lines = [
        f"dp=2, demo model, {args.rounds} rounds x {args.steps} steps per system, interleaved",
        "",
        f"| system | step time (ms) | / {reference} (median of per-round ratios) | last loss |",
        "|---|---|---|---|",
    ]
    for system in args.systems:
        lines.append(
            f"| {system} | {statistics.median(times[system]) * 1e3:.1f} | "
            f"{statistics.median(ratios[system]):.3f} | {losses[system]:.6f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
