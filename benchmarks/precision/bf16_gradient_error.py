"""How far bf16 gradients are from fp32's, for our GPT (models.gpt) and its plain twin.

    python benchmarks/precision/bf16_gradient_error.py [--batches 3]

Both models start from the same weights (our GPT's draw, loaded into
benchmarks/compare/plain_gpt.py) with the demo's shape and a byte vocabulary. For each
batch of 4 x 128 tokens from the bundled corpus, each model's gradient is taken in fp32
and with every parameter in bf16, and compared with the plain twin's fp32 gradient (the
reference, computed by nothing of ours): the relative error of the whole gradient, its
projection on the reference (a systematic scaling would show there), and the three
parameters with the largest relative error. Written to benchmarks/precision/bf16_gradient_error.md.

Our GPT's LayerNorm (models.gpt.norms.LayerNorm) computes in fp32 from its bf16 input on
CPU; the twin's is torch's nn.LayerNorm, whose CPU bf16 backward accumulates the LayerNorm
gradients with a relative error of 0.05-0.06 here. With --fp32-layernorm the twin's
nn.LayerNorm also computes in fp32 and returns the input's dtype, as autocast and
Megatron's fused LayerNorm do, so both models' remaining errors can be compared.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.compare.plain_gpt import PlainGPT  # noqa: E402
from benchmarks.precision.grad_reduce_drift_plain import loss_of  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

Gradients = dict[str, torch.Tensor]


def fp32_layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm.forward in fp32: statistics, affine and their gradients (our GPT's
    LayerNorm overrides forward, so this reaches only the twin's)."""
    weight = self.weight.float() if self.weight is not None else None
    bias = self.bias.float() if self.bias is not None else None
    y = F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)
    return y.to(x.dtype)


def gradients(
    model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor], dtype: torch.dtype
) -> Gradients:
    model.to(dtype).zero_grad(set_to_none=True)
    loss(model).backward()
    out = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    model.float().zero_grad(set_to_none=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--fp32-layernorm", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.fp32_layernorm:
        nn.LayerNorm.forward = fp32_layer_norm
    suffix = "_fp32_layernorm.md" if args.fp32_layernorm else ".md"
    out = args.out or Path(__file__).with_name(Path(__file__).stem + suffix)
    config = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=256)
    ours = GPT(config, seed=1234)
    plain = PlainGPT(config)
    plain.load_state_dict({k: v.detach().clone() for k, v in ours.state_dict().items()})
    with gzip.open(ROOT / "launch" / "assets" / "shakespeare.txt.gz", "rb") as f:
        corpus = torch.from_numpy(np.frombuffer(f.read(), dtype=np.uint8).copy()).long()
    generator = torch.Generator().manual_seed(0)
    lines = [
        "| batch | model | dtype | relative error | projection | largest relative errors |",
        "|---:|---|---|---:|---:|---|",
    ]
    for batch in range(args.batches):
        starts = torch.randint(0, len(corpus) - 129, (4,), generator=generator)
        x = torch.stack([corpus[i : i + 128] for i in starts])
        y = torch.stack([corpus[i + 1 : i + 129] for i in starts])
        runs = {
            ("ours", dtype): gradients(ours, lambda m, x=x, y=y: m(x, y), dtype)
            for dtype in (torch.float32, torch.bfloat16)
        } | {
            ("plain", dtype): gradients(plain, lambda m, x=x, y=y: loss_of(m, x, y), dtype)
            for dtype in (torch.float32, torch.bfloat16)
        }
        reference = runs["plain", torch.float32]
        flat_ref = torch.cat([g.flatten() for g in reference.values()])
        for (model, dtype), grads in runs.items():
            flat = torch.cat([grads[name].flatten() for name in reference])
            error = float((flat - flat_ref).norm() / flat_ref.norm())
            projection = float(torch.dot(flat - flat_ref, flat_ref) / flat_ref.norm() ** 2)
            worst = sorted(
                (float((grads[n] - g).norm() / g.norm()), n) for n, g in reference.items()
            )[-3:]
            named = ", ".join(f"{n} {e:.3f}" for e, n in reversed(worst))
            lines.append(
                f"| {batch} | {model} | {str(dtype)[6:]} | {error:.2e} | {projection:+.2e} | "
                f"{named} |"
            )
    text = "\n".join(lines)
    print(text)
    title = "# bf16 gradients against fp32's" + (", LayerNorm in fp32" * args.fp32_layernorm)
    out.write_text(f"{title}\n\n{text}\n")


if __name__ == "__main__":
    main()
