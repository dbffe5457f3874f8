"""Model-state bytes and communication per rank for ZeRO stages 0-3 against the paper.

    python benchmarks/memory/zero_accounting.py [--layers 4 --hidden 384 --vocab 8192]

A GPT of about 10M parameters in bf16 (2-byte parameters and gradients, fp32 master and
Adam moments: K = 12) runs one optimizer step at dp = 1, 2, 4 for each stage. Printed for
rank 0: the model-state bytes the engine counts from its tensors against the formulas of
hybrid.memory (ZeRO, arXiv 1910.02054, section 5; at stage 1 the gradient shard, not the
paper's full gradients: the engine frees them once reduced), with Psi this TP rank's count
(the ratio column) and with Psi plus the buckets' padding (exact), and the bytes moved over
DP in the step against 2 x 2 Psi (N-1)/N for stages 0-2 and 3 x 2 Psi (N-1)/N for stage 3
(ring algorithms: an all-reduce of S bytes moves 2S(N-1)/N, a reduce-scatter or all-gather
of S bytes S(N-1)/N). The transient communication buffers (gradient buckets in flight,
gathered stage-3 parameters) are reported apart: they are not model states.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybrid.distributed.env import init_distributed, shutdown
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.instruments.local_processes import run_processes
from hybrid.memory import dp_traffic_bytes, engine_state_bytes
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig


def measure_stages(config: GPTConfig, stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    """On every rank of a torchrun-style job: one bf16 step per stage; per stage this
    rank's model-state bytes, the bytes moved over DP, Psi and the padding."""
    env = init_distributed()
    try:
        topology = Topology.build(1)
        results = []
        for stage in stages:
            tp = TensorParallel.from_topology(topology, seed=0)
            model = GPT(config, tp, seed=0)
            engine = Engine(
                model,
                topology,
                tp,
                EngineConfig(zero_stage=stage, precision="bf16"),
                units=list(model.blocks),
            )
            ids = torch.randint(0, config.vocab_size, (2, config.seq_len + 1))
            topology.counter.reset()
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step(1e-4)
            n = topology.dp
            moved = sum(
                nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)
                for (kind, group), nbytes in topology.counter.bytes.items()
                if group == "dp"
            )
            results.append(
                {
                    "stage": stage,
                    "bytes": engine.model_state_bytes(),
                    "moved": moved,
                    "psi": sum(b.numel - b.padding for b in engine.buckets),
                    "padding": sum(b.padding for b in engine.buckets),
                }
            )
        return results
    finally:
        shutdown(env)


def state_bytes(measured: dict) -> int:
    """Parameters + gradients + optimizer states (not the transient buffers)."""
    b = measured["bytes"]
    return b["parameters"] + b["gradients"] + b["optimizer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "zero_accounting.md")
    args = parser.parse_args()
    config = GPTConfig(
        n_layer=args.layers, n_head=6, d_model=args.hidden, seq_len=128, vocab_size=args.vocab
    )
    header = (
        "| stage | dp | Psi | padding | measured bytes | formula | ratio | formula (Psi + "
        "padding) | buffers (peak) | moved bytes | formula | ratio |"
    )
    lines = [header, "|---:" * 12 + "|"]
    for dp in (1, 2, 4):
        ranks = run_processes(measure_stages, dp, config, timeout_s=600)
        for r in ranks[0]:
            stage, psi, pad = r["stage"], r["psi"], r["padding"]
            measured = state_bytes(r)
            expected = sum(engine_state_bytes(stage, psi, dp).values())
            exact = sum(engine_state_bytes(stage, psi + pad, dp).values())
            moved, moved_formula = r["moved"], dp_traffic_bytes(stage, psi, dp)
            lines.append(
                f"| {stage} | {dp} | {psi:,} | {pad} | {measured:,} | {expected:,.0f} | "
                f"{measured / expected:.4f} | {exact:,.0f} | {r['bytes']['buffers']:,} | "
                f"{moved:,.0f} | {moved_formula:,.0f} | "
                f"{moved / moved_formula if moved_formula else 1:.4f} |"
            )
        total = sum(state_bytes(rank[3]) for rank in ranks)
        psi, pad = ranks[0][3]["psi"], ranks[0][3]["padding"]
        lines.append(
            f"\nStage 3 at dp={dp}: bytes over all ranks {total:,} = 16 x (Psi + padding "
            f"{pad}) = {16 * (psi + pad):,}\n"
            if dp > 1
            else ""
        )
    text = "\n".join(line for line in lines if line)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
