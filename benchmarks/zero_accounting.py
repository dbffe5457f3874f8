"""Model-state bytes and communication per rank for ZeRO stages 0-3 against the paper.

    python benchmarks/zero_accounting.py [--layers 4 --hidden 384 --vocab 8192]

A GPT of about 10M parameters in bf16 (2-byte parameters and gradients, fp32 master and
Adam moments: K = 12) runs one optimizer step at dp = 1, 2, 4 for each stage. Printed per
rank 0: the engine's model-state bytes against (ZeRO, arXiv 1910.02054, section 5)
  stage 0: (2 + 2 + K) Psi, stage 1: 4 Psi + K Psi/N, stage 2: 2 Psi + (2 + K) Psi/N,
  stage 3: (2 + 2 + K) Psi/N,
with Psi this TP rank's parameter count, and the bytes moved over DP in the step (ring
algorithms: an all-reduce of S bytes moves 2S(N-1)/N, a reduce-scatter or all-gather of S
bytes moves S(N-1)/N) against 2 x 2Psi (N-1)/N for stages 0-2 and 3 x 2Psi (N-1)/N for
stage 3. Our stage 3 gathers the non-layer parameters (embeddings, final LayerNorm) once
per step and keeps them through backward, so it moves 2 x their bytes less than 3 x.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybrid.distributed import init_distributed, shutdown
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from hybrid.testing import run_processes
from hybrid.topology import Topology
from models.gpt import GPT, GPTConfig

K = 12


def formula_bytes(stage: int, psi: int, n: int) -> float:
    return {
        0: (2 + 2 + K) * psi,
        1: 4 * psi + K * psi / n,
        2: 2 * psi + (2 + K) * psi / n,
        3: (2 + 2 + K) * psi / n,
    }[stage]


def formula_moved(stage: int, psi: int, n: int) -> float:
    return (3 if stage == 3 else 2) * 2 * psi * (n - 1) / n


def one_step(stage: int, config: GPTConfig) -> dict:
    env = init_distributed()
    try:
        topology = Topology.build(1)
        tp = TensorParallel.from_topology(topology, seed=0)
        model = GPT(config, tp, seed=0)
        root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
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
        ring = (n - 1) / n
        moved = 0.0
        for (kind, group), nbytes in topology.counter.bytes.items():
            if group == "dp":
                moved += nbytes * ring * (2 if kind == "all_reduce" else 1)
        return {
            "bytes": engine.model_state_bytes(),
            "moved": moved,
            "root": root,
            "psi": sum(b.numel - b.padding for b in engine.buckets),
            "padding": sum(b.padding for b in engine.buckets),
        }
    finally:
        shutdown(env)


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
    lines = [
        "| stage | dp | Psi | measured bytes | formula | ratio | moved bytes | formula | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stage in range(4):
        for dp in (1, 2, 4):
            ranks = run_processes(one_step, dp, stage, config, timeout_s=600)
            r = ranks[0]
            psi, measured = r["psi"], sum(r["bytes"].values())
            expected = formula_bytes(stage, psi, dp)
            moved, moved_formula = r["moved"], formula_moved(stage, psi, dp)
            lines.append(
                f"| {stage} | {dp} | {psi:,} | {measured:,} | {expected:,.0f} | "
                f"{measured / expected:.4f} | {moved:,.0f} | {moved_formula:,.0f} | "
                f"{moved / moved_formula if moved_formula else 1:.4f} |"
            )
            if stage == 3:
                total = sum(sum(x["bytes"].values()) for x in ranks)
                lines.append(
                    f"|   |   | stage 3 total over ranks: {total:,} = 16 x (Psi + padding "
                    f"{r['padding']}) = {16 * (psi + r['padding']):,} | | | | | | |"
                )
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
