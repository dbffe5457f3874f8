"""The drift benchmark's independent reference: the same question asked of plain PyTorch.

    python benchmarks/precision/grad_reduce_drift_plain.py [--steps 300 --seeds 1234 1]

benchmarks/precision/grad_reduce_drift.py finds that bf16 training of the demo ends *below* fp32's
loss, with either gradient reduction. This script asks whether that is our engine's doing.
It trains the plain-PyTorch twin of the demo's model (benchmarks/compare/plain_gpt.py:
nn.Linear, nn.LayerNorm, torch AdamW; none of hybrid's code) in one process, on the
bundled corpus's bytes (vocabulary 256) with the demo's schedule (lr 3e-3 to 3e-4,
warm-up 20, weight decay 0.1, clip 1.0, betas 0.9/0.95), 16 sequences of 128 a step in 8
micro-batches of 2: the demo's 2 ranks x 4 micro-batches, so bf16 accumulation over the 8
stands in for the 4 local sums and the 2-way reduction. Three runs per seed, from the same
weights and batches:
- fp32;
- bf16, fp32 accumulation: the model's parameters in bf16, fp32 master weights and Adam
  moments, each micro-batch's bf16 gradient added into an fp32 sum (what our engine does
  with train.grad_reduce_dtype=fp32, and Megatron's default);
- bf16, bf16 accumulation: the same, the gradients summed in bf16 by autograd.
The loss is taken in fp32 from the bf16 logits, as models.gpt does. Reported: the mean
training loss of the last 20 steps and its gap to fp32's. Written to
benchmarks/precision/grad_reduce_drift_plain.md. Each bf16 run takes about 10 minutes of one core.
"""

from __future__ import annotations

import argparse
import gzip
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.compare.plain_gpt import PlainGPT  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.train.schedule import lr_at  # noqa: E402
from models.gpt import GPTConfig  # noqa: E402

RUNS = ("fp32", "bf16, fp32 accumulation", "bf16, bf16 accumulation")
LAST, SEQ, BATCH, MICRO = 20, 128, 16, 8
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 20


def gpt2_init(model: PlainGPT, layers: int) -> None:
    """GPT-2's initialisation (Radford et al. 2019), as models.gpt draws it: weights from
    N(0, 0.02), the residual projections' scaled by 1/sqrt(2 x layers), biases 0, norms 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                scale = 1 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 1.0
                p.normal_(0.0, 0.02 * scale)


def loss_of(model: PlainGPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The twin's forward, with the cross-entropy taken in fp32 from its logits."""
    h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
    for block in model.blocks:
        h = block(h)
    logits = model.logits(model.ln_f(h))
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train(run: str, seed: int, steps: int) -> list[float]:
    """The per-step training losses of one run."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=SEQ, vocab_size=256)
    model = PlainGPT(config)
    gpt2_init(model, config.n_layer)
    with gzip.open(ROOT / "launch" / "assets" / "shakespeare.txt.gz", "rb") as f:
        corpus = torch.from_numpy(np.frombuffer(f.read(), dtype=np.uint8).copy()).long()
    batches = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    masters = params
    if run != "fp32":  # fp32 masters; the model computes in bf16
        masters = [p.detach().clone().requires_grad_(True) for p in params]
        model.to(torch.bfloat16)
    groups = [
        {"params": [m for m in masters if m.ndim >= 2], "weight_decay": 0.1},
        {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    schedule = TrainConfig(steps=steps, lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP)  # the demo's
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        starts = torch.randint(0, len(corpus) - SEQ - 1, (BATCH,), generator=batches)
        x = torch.stack([corpus[i : i + SEQ] for i in starts])
        y = torch.stack([corpus[i + 1 : i + SEQ + 1] for i in starts])
        total = 0.0
        for k in range(MICRO):
            loss = loss_of(model, x[k::MICRO], y[k::MICRO])
            (loss / MICRO).backward()
            total += loss.item() / MICRO
            if run == "bf16, fp32 accumulation":  # each bf16 gradient added in fp32
                for master, p in zip(masters, params, strict=True):
                    g = p.grad.float()
                    master.grad = g if master.grad is None else master.grad.add_(g)
                    p.grad = None
        if run == "bf16, bf16 accumulation":  # autograd summed them in bf16
            for master, p in zip(masters, params, strict=True):
                master.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if run != "fp32":
            with torch.no_grad():
                for master, p in zip(masters, params, strict=True):
                    p.copy_(master)
        losses.append(total)
    return losses


def timed(run: str, seed: int, steps: int) -> tuple[float, float]:
    start = time.perf_counter()
    losses = train(run, seed, steps)
    return statistics.fmean(losses[-LAST:]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    args = parser.parse_args()
    jobs = [(run, seed) for seed in args.seeds for run in RUNS]
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {job: pool.submit(timed, *job, args.steps) for job in jobs}
        results = {job: future.result() for job, future in futures.items()}
    lines = [
        f"Plain-PyTorch twin of configs/tiny.yaml's model (byte vocabulary), {args.steps} "
        f"steps, one process, {BATCH} sequences of {SEQ} per step in {MICRO} micro-batches; "
        f"mean training loss of the last {LAST} steps.",
        "",
        "| seed | run | loss (last 20) | gap to fp32 | relative | wall (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for seed in args.seeds:
        reference = results["fp32", seed][0]
        for run in RUNS:
            mean, seconds = results[run, seed]
            gap = mean - reference
            lines.append(
                f"| {seed} | {run} | {mean:.5f} | {gap:+.5f} | {gap / reference:+.3%} | "
                f"{seconds:.0f} |"
            )
    text = "\n".join(lines)
    print(text)
    title = "# Gradient accumulation dtype, plain PyTorch: drift from fp32"
    args.out.write_text(f"{title}\n\n{text}\n")


if __name__ == "__main__":
    main()
