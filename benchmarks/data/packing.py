"""Fine-tuning throughput of real (non-padding) tokens: packed (data.pack=true) against
padded, on short prompt/completion examples.

    python benchmarks/data/packing.py [--windows 64 128 256 --rounds 5 --steps 2]

The examples are consecutive lines of the bundled Shakespeare (prompt: one line,
completion: the next), tokenized with GPT-2's tokenizer through launch.data.examples: about
20 tokens each. For each window (train.seq_len) both sets train the same model (GPT-2
style, 4 layers, d_model 64, fp32, one process, one thread) through launch.train.step's
train_step and the Engine, with batches of the same shape (rows x window): padded, one
example to a row; packed, as many as fit (next fit), with the block-diagonal mask.

Real tokens are the input positions inside an example (what the loss and the mask see
as data), counted from the batches; the clock is time.perf_counter around each step. The
machine is shared and noisy, so the two alternate (A B A B ...) `rounds` times, each
taking `steps` steps; each round gives the ratio packed / padded of real tokens per
second, and the table reports the median ratio and its range over rounds against the
packing factor (real tokens per row, packed / padded).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from launch.data.examples import read_examples
from launch.data.token_file import BUNDLED_CORPUS
from launch.data.tokenizers import gpt2_tokenizer
from launch.train.step import train_step
from models.gpt import GPT, GPTConfig, pad_vocab_size

ROWS = 8  # rows per step, packed or padded


def write_records(path: Path, n: int) -> Path:
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        lines = [line for line in f.read(2_000_000).splitlines() if line.strip()]
    with path.open("w") as out:
        for i in range(n):
            record = {"prompt": lines[2 * i] + "\n", "completion": lines[2 * i + 1]}
            out.write(json.dumps(record) + "\n")
    return path


def real_tokens(batch: tuple[torch.Tensor, ...], pad_segment: bool) -> int:
    """Input positions inside an example: for packed rows every segment but the padding
    (the last, when the row is not full); for padded rows up to the example's last target."""
    if pad_segment:
        _, targets, segments = batch
        last = segments.max(dim=1, keepdim=True).values
        used = (segments != last) | (targets[:, -1:] != -100)  # a full row has no padding
        return int(used.sum())
    targets = batch[1]
    positions = torch.arange(targets.shape[1]).expand_as(targets)
    last_target = torch.where(targets != -100, positions, -1).max(dim=1).values
    return int((last_target + 1).sum())


def engine_for(window: int, seed: int = 0) -> Engine:
    config = GPTConfig(
        n_layer=4, n_head=4, d_model=64, seq_len=window, vocab_size=pad_vocab_size(50257)
    )
    topology = Topology.single()
    parallel = TensorParallel.from_topology(topology, seed)
    model = GPT(config, parallel, seed=seed)
    return Engine(model, topology, parallel, EngineConfig(micro_batches=1), list(model.blocks))


def measure(window: int, rounds: int, steps: int, folder: Path) -> dict[str, float]:
    records = write_records(folder / "records.jsonl", 4000)
    examples = read_examples([records], gpt2_tokenizer(), window, folder)
    sets = {"padded": examples.split(0.01)[0], "packed": examples.split(0.01, packed=True)[0]}
    engines = {name: engine_for(window) for name in sets}
    cursor = dict.fromkeys(sets, 0)
    counts: dict[str, list[float]] = {name: [] for name in sets}

    def step(name: str) -> tuple[int, float, float]:
        data, start = sets[name], cursor[name]
        ids = np.arange(start, start + ROWS) % len(data)
        cursor[name] += ROWS
        batch = data.batch(ids)
        began = time.perf_counter()
        loss, _, _ = train_step(engines[name], [batch], 1e-3, torch.device("cpu"))
        return real_tokens(batch, name == "packed"), time.perf_counter() - began, loss

    for name in sets:  # warm-up, untimed
        step(name)
    ratios = []
    for _ in range(rounds):
        rate = {}
        for name in sets:  # A B A B: both measured side by side in every round
            done = [step(name) for _ in range(steps)]
            tokens, seconds = sum(d[0] for d in done), sum(d[1] for d in done)
            counts[name].append(tokens / (steps * ROWS))
            rate[name] = tokens / seconds
        ratios.append(rate["packed"] / rate["padded"])
    per_row = {name: statistics.mean(values) for name, values in counts.items()}
    return {
        "window": window,
        "padded_tokens_per_row": per_row["padded"],
        "packed_tokens_per_row": per_row["packed"],
        "packing_factor": per_row["packed"] / per_row["padded"],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "padded_tokens_per_s": rate["padded"],
        "packed_tokens_per_s": rate["packed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(
        "| window | real tokens/row padded | packed | packing factor | "
        "tokens/s ratio packed/padded (median) | range | last round tokens/s padded / packed |"
    )
    print("|---:|---:|---:|---:|---:|---|---|")  # fmt: skip
    for window in args.windows:
        with tempfile.TemporaryDirectory() as folder:
            r = measure(window, args.rounds, args.steps, Path(folder))
        print(
            f"| {window} | {r['padded_tokens_per_row']:.1f} | {r['packed_tokens_per_row']:.1f} | "
            f"{r['packing_factor']:.2f}x | {r['ratio_median']:.2f}x | "
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | "
            f"{r['padded_tokens_per_s']:,.0f} / {r['packed_tokens_per_s']:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
