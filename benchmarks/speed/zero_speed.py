"""Step time of ZeRO stages 0-3 at dp=2 against stage 0 and torch DDP, on the demo model.

    python benchmarks/speed/zero_speed.py [--rounds 5 --steps 30 --block 5]

The model and batch are the CPU demo's (configs/tiny.yaml: 4 layers, d_model 128, seq 128,
vocab 512, global batch 16 = 2 ranks x 1 micro-batch of 8, fp32, AdamW, clipping at 1.0).
This machine is shared and noisy, so the systems alternate inside one 2-process gloo job
(each system with its own copy of the model), in blocks of `--block` consecutive steps
(A x5, B x5, ..., A x5, ...): stages 1-2 leave their parameter all-gathers in flight for the
next step's forward (hybrid.zero.publish), so a block ends by waiting for them
(Engine.wait_for_parameters) inside its timing, and no system's communication runs in
another's time. A system's step time is the median over its blocks of the block's time per
step; each round (a fresh job) gives the ratio of every system to stage 0 measured side by
side; the table reports the median of the per-round ratios and their range. The
"-waited" systems are stages 1-2 waiting for every gather in the step
(overlap_param_gather=False), as before the overlap. The "-gloo" systems are stages 1-3
on gloo's own reduce-scatter and all-gather instead of the pairwise exchanges the engine
runs on gloo (hybrid.distributed.pairwise; stage 3's prefetch keeps gloo's own in both). The last
loss of every system is printed so that a faster wrong answer shows.

Each round also measures the collectives alone, on the same two processes: the CPU time
(time.process_time, the kernel's count for the process, gloo's threads included) and the
wall time of one all-reduce, reduce-scatter and all-gather of the model's parameter count
in fp32, gloo's own and pairwise. The two ranks keep both cores busy computing, so CPU
time a collective spends is time the step loses however well it overlaps: the extra CPU
time of stages 1-2's (pairwise) reduce-scatter and all-gather over stage 0's all-reduce,
as a fraction of stage 0's step, is the least they can cost here (the "bound" line).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hybrid.distributed import pairwise
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.instruments.local_processes import run_processes
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=512)
MICRO, LR, CLIP, WEIGHT_DECAY, WARMUP = 8, 1e-3, 1.0, 0.1, 3
SYSTEMS = [
    "ddp",
    "stage0",
    "stage1",
    "stage2",
    "stage3",
    "stage1-waited",
    "stage2-waited",
    "stage1-gloo",
    "stage2-gloo",
    "stage3-gloo",
]


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


def make_step(system: str, topology: Topology) -> tuple[Callable, Callable]:
    """The system's step (returns the loss) and what ends its work in flight. `topology`
    is the one the "-gloo" systems are given: its DP group uses gloo's own collectives."""
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

        return ddp_step, lambda: None
    stage, _, variant = system.removeprefix("stage").partition("-")
    config = EngineConfig(
        zero_stage=int(stage),
        grad_clip=CLIP,
        weight_decay=WEIGHT_DECAY,
        overlap_param_gather=variant != "waited",
    )
    engine = Engine(model, topology, tp, config, units=list(model.blocks))

    def engine_step(x: torch.Tensor) -> float:
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step(LR)
        return loss.item()

    return engine_step, engine.wait_for_parameters


def collective_costs(numel: int, repeats: int = 20) -> dict[str, dict[str, float]]:
    """Per call, milliseconds of CPU time (this process, all its threads) and of wall
    time of each collective stages 0-2 use, on `numel` fp32 elements, medians of
    `repeats` after a warm-up call, the ranks aligned by a barrier before each: gloo's
    own, and the pairwise exchanges (hybrid.distributed.pairwise) the engine uses on gloo."""
    full = torch.randn(numel - numel % 2)
    shard, gathered = torch.empty(full.numel() // 2), torch.empty(full.numel())
    group = dist.group.WORLD
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all_gather": lambda: dist.all_gather_single(gathered, shard),
        "pairwise reduce_scatter": lambda: pairwise.reduce_scatter(shard, full, group, 1).wait(),
        "pairwise all_gather": lambda: pairwise.all_gather(gathered, shard, group, 2).wait(),
    }
    costs = {}
    for name, call in calls.items():
        call()
        cpu, wall = [], []
        for _ in range(repeats):
            dist.barrier()
            c, w = time.process_time(), time.perf_counter()
            call()
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
        costs[name] = {"cpu": statistics.median(cpu), "wall": statistics.median(wall)}
    return costs


def job(systems: list[str], steps: int, block: int) -> dict[str, dict[str, float]]:
    """One round on every rank: the systems interleaved block by block."""
    torch.set_num_threads(1)  # what torchrun gives each of several local ranks
    env = init_distributed()
    try:
        topology, gloo_own = Topology.build(1), Topology.build(1)
        gloo_own.dp_group.pairwise = False
        steppers = {s: make_step(s, gloo_own if s.endswith("-gloo") else topology) for s in systems}
        times: dict[str, list[float]] = {s: [] for s in systems}
        losses: dict[str, float] = {}
        data = batches(WARMUP + steps, topology.dp_rank)
        for step, settle in steppers.values():  # warm-up, untimed
            for x in data[:WARMUP]:
                step(x)
            settle()
        for start in range(WARMUP, len(data), block):
            chunk = data[start : start + block]
            for system, (step, settle) in steppers.items():
                tick = time.perf_counter()
                for x in chunk:
                    losses[system] = step(x)
                settle()
                times[system].append((time.perf_counter() - tick) / len(chunk))
        result = {s: {"time": statistics.median(times[s]), "loss": losses[s]} for s in systems}
        numel = sum(p.numel() for p in GPT(CONFIG, seed=0).parameters())
        return result | {"collectives": collective_costs(numel)}
    finally:
        shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--block", type=int, default=5, help="consecutive steps per system")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "zero_speed.md")
    args = parser.parse_args()
    times: dict[str, list[float]] = {s: [] for s in args.systems}
    ratios: dict[str, list[float]] = {s: [] for s in args.systems}
    losses: dict[str, float] = {}
    costs: list[dict[str, dict[str, float]]] = []
    bounds: list[float] = []
    reference = "stage0" if "stage0" in args.systems else args.systems[0]
    for r in range(args.rounds):
        result = run_processes(job, 2, args.systems, args.steps, args.block, timeout_s=900)[0]
        c = result["collectives"]
        costs.append(c)
        used = ("pairwise reduce_scatter", "pairwise all_gather")  # what the engine uses
        extra = sum(c[name]["cpu"] for name in used) - c["all_reduce"]["cpu"]
        bounds.append(1 + extra / result[reference]["time"])
        for system in args.systems:
            times[system].append(result[system]["time"])
            ratios[system].append(result[system]["time"] / result[reference]["time"])
            losses[system] = result[system]["loss"]
        print(
            f"round {r + 1}: " + " ".join(f"{s} {times[s][-1] * 1e3:.1f}ms" for s in args.systems),
            flush=True,
        )
    lines = [
        f"dp=2, demo model, {args.rounds} rounds x {args.steps} steps per system, interleaved "
        f"in blocks of {args.block} steps",
        "",
        f"| system | step time (ms) | / {reference} (median of per-round ratios) | range "
        "| last loss |",
        "|---|---|---|---|---|",
    ]
    for system in args.systems:
        spread = f"{min(ratios[system]):.3f}-{max(ratios[system]):.3f}"
        lines.append(
            f"| {system} | {statistics.median(times[system]) * 1e3:.1f} | "
            f"{statistics.median(ratios[system]):.3f} | {spread} | {losses[system]:.6f} |"
        )
    lines += [
        "",
        "The collectives alone, per call on the model's parameters in fp32 (ms, median over "
        "rounds):",
        "",
        "| collective | CPU time | wall time |",
        "|---|---|---|",
    ]
    for name in costs[0]:
        cpu = statistics.median(c[name]["cpu"] for c in costs) * 1e3
        wall = statistics.median(c[name]["wall"] for c in costs) * 1e3
        lines.append(f"| {name} | {cpu:.2f} | {wall:.2f} |")
    lines += [
        "",
        f"bound: stages 1-2 / {reference} >= 1 + (pairwise reduce-scatter + all-gather - "
        f"all-reduce CPU time) / {reference} step = {statistics.median(bounds):.3f} "
        f"({min(bounds):.3f}-{max(bounds):.3f}) on this machine",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
