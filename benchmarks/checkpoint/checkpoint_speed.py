"""Checkpoint save speed against a raw write of the same bytes to the same folder.

    python benchmarks/checkpoint/checkpoint_speed.py [--reps 5] [--ranks 2] [--layers 24] \
        [--d-model 512]

Two gloo ranks (dp=2, ZeRO-3; `--ranks 1`: one, with this machine's second core free)
of a GPT (24 layers, d_model 512, vocabulary 512: about
76M parameters, 12 bytes each in a checkpoint, ~870 MiB per checkpoint). Each repetition
alternates, in one folder:
- raw: every rank writes its share of the checkpoint's bytes (one file, then fsync);
- sync: `save_checkpoint` (shards, random states, checksums, rename, `latest`): training
  waits for all of it;
- DCP alone: `dcp.save` of the same pieces with DCP's plain writer (no checksum, no
  commit): the floor of a save through DCP;
- async: `CheckpointWriter(asynchronous=True).save` returns after the host copy (the
  stall); training steps run while the thread writes; the steps' extra time over a step
  with no save in flight is added to the stall.
Each figure is the slowest rank's (the job waits for it). Ratios are per repetition
(save / the raw write next to it); the table gives their median and range. Writes
benchmarks/checkpoint/checkpoint_speed.md and .json (checkpoint_speed_<N>rank.* for another
--ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybrid.instruments.local_processes import run_processes  # noqa: E402


def _rank(root: str, reps: int, layers: int, d_model: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hybrid.checkpoint.chunks import ChunkSavePlanner
    from hybrid.checkpoint.engine_state import _state_dict, save_checkpoint
    from hybrid.checkpoint.saver import CheckpointWriter
    from hybrid.distributed.env import init_distributed, shutdown
    from hybrid.distributed.topology import Topology
    from hybrid.engine import Engine, EngineConfig
    from hybrid.tensor_parallel import TensorParallel
    from models.gpt import GPT, GPTConfig

    env = init_distributed()
    if not dist.is_initialized():  # one rank: a group of one, so the script runs alike
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = GPTConfig(n_layer=layers, n_head=8, d_model=d_model, seq_len=64, vocab_size=512)
        topology = Topology.build(1)
        tp = TensorParallel.from_topology(topology, 0)
        model = GPT(config, tp, device="meta")
        engine = Engine(model, topology, tp, EngineConfig(zero_stage=3), units=list(model.blocks))
        ids = torch.randint(
            0, 512, (2, 65), generator=torch.Generator().manual_seed(dist.get_rank())
        )
        writer = CheckpointWriter(asynchronous=True)
        folder = Path(root)
        nbytes = sum(state.master.numel() * 12 for state in engine.states)
        payload = torch.zeros(nbytes, dtype=torch.uint8)

        def step() -> float:
            tick = time.perf_counter()
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step(1e-4)
            return time.perf_counter() - tick

        def slowest(seconds: float) -> float:
            value = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            return float(value)

        step()  # warm-up
        rows = []
        for rep in range(reps):
            row: dict[str, float] = {"bytes_per_rank": float(nbytes)}
            dist.barrier()
            tick = time.perf_counter()
            with open(folder / f"raw_{dist.get_rank()}", "wb") as out:
                out.write(memoryview(payload.numpy()))
                out.flush()
                os.fsync(out.fileno())
            row["raw_s"] = slowest(time.perf_counter() - tick)
            os.remove(folder / f"raw_{dist.get_rank()}")

            dist.barrier()
            tick = time.perf_counter()
            save_checkpoint(engine, folder, 2 * rep + 1, {"step": rep}, {}, keep=1)
            row["sync_s"] = slowest(time.perf_counter() - tick)

            # The floor without checksums: DCP's own writer (shards and index only).
            dist.barrier()
            tick = time.perf_counter()
            plain = dcp.FileSystemWriter(str(folder / f"plain_{rep}"))
            dcp.save(_state_dict(engine), storage_writer=plain, planner=ChunkSavePlanner())
            row["dcp_only_s"] = slowest(time.perf_counter() - tick)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(folder / f"plain_{rep}")

            baseline = statistics.median(step() for _ in range(3))
            dist.barrier()
            tick = time.perf_counter()
            writer.save(engine, folder, 2 * rep + 2, {"step": rep}, {}, keep=1)
            stall = writer.stall_s
            committed: list[float] = []
            writer.pending.add_done_callback(lambda _, c=committed: c.append(time.perf_counter()))
            # As many steps as the synchronous save lasted, the same number on every rank
            # (they are collectives): their time beyond a plain step is the save's too.
            steps = int(row["sync_s"] / baseline) + 1
            extra = sum(max(0.0, step() - baseline) for _ in range(steps))
            writer.wait()
            row["async_total_s"] = slowest(committed[0] - tick)
            row["async_stall_s"] = slowest(stall)
            row["async_stall_with_steps_s"] = slowest(stall + extra)
            row["step_s"] = slowest(baseline)
            rows.append(row)
        writer.close()
        return rows
    finally:
        shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--ranks", type=int, default=2, help="dp degree (2: both of this machine's cores busy)"
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temp one)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt_speed_", dir=args.dir))
    try:
        rows = run_processes(
            _rank, args.ranks, str(root), args.reps, args.layers, args.d_model, timeout_s=3600
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = ROOT / "benchmarks" / "checkpoint"
    name = "checkpoint_speed" if args.ranks == 2 else f"checkpoint_speed_{args.ranks}rank"
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{name}.md").write_text(_table(rows, args))
    print(_table(rows, args))


def _table(rows: list[dict[str, float]], args: argparse.Namespace) -> str:
    mib = rows[0]["bytes_per_rank"] * args.ranks / 2**20

    def ratio(key: str) -> str:
        values = [r[key] / r["raw_s"] for r in rows]
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    def seconds(key: str) -> str:
        return f"{statistics.median(r[key] for r in rows):.2f}"

    lines = [
        "# Checkpoint save speed",
        "",
        f"`python benchmarks/checkpoint/checkpoint_speed.py --reps {args.reps} "
        f"--ranks {args.ranks}`: "
        f"{args.ranks} gloo rank(s), dp={args.ranks}, "
        f"ZeRO-3, {args.layers} layers, d_model {args.d_model}, {mib:.0f} MiB per checkpoint; "
        f"{len(rows)} repetitions, alternating. Ratios: time / the raw write (fsync) of the "
        "same bytes to the same folder in the same repetition; median (range). Bandwidth: "
        "raw / save.",
        "",
        "| | median s | / raw write | training waits (median s) |",
        "|---|---|---|---|",
        f"| raw write + fsync | {seconds('raw_s')} | 1 | |",
        f"| synchronous save | {seconds('sync_s')} | {ratio('sync_s')} | {seconds('sync_s')} |",
        f"| DCP's writer alone: shards and index, no checksums, no commit | "
        f"{seconds('dcp_only_s')} | {ratio('dcp_only_s')} | |",
        f"| async save, until committed | {seconds('async_total_s')} | "
        f"{ratio('async_total_s')} | {seconds('async_stall_s')} (host copy) |",
        f"| async save, host copy + slower steps while writing | | "
        f"{ratio('async_stall_with_steps_s')} | {seconds('async_stall_with_steps_s')} |",
        "",
        f"A training step without a save: {seconds('step_s')} s.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
