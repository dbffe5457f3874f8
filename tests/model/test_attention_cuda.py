"""On CUDA: batches are copied from pinned memory, and attention with dropout runs
SDPA's fused kernel with `dropout_p` (no s x s tensor kept), draws reproducibly
(recomputation gives the same gradients) and drops what it should. Skipped without a
GPU; on CPU the explicit path is tested elsewhere (tests/model/test_model.py,
tests/zero/test_stage3_memory.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid.recompute import Recompute, RecomputePolicy
from models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SEQ, BATCH = 1024, 2
CONFIG = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=SEQ, vocab_size=128, dropout=0.1)


def _loss_and_grads(recompute: Recompute, dropout: float, seed: int = 7) -> tuple:
    config = dataclasses.replace(CONFIG, dropout=dropout)
    model = GPT(config, recompute=RecomputePolicy(recompute), seed=1, device="cuda").train()
    idx = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    idx = idx.cuda()
    torch.cuda.manual_seed(seed)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(idx, idx.roll(-1, dims=1))
    peak = torch.cuda.max_memory_allocated() - start
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], peak


def test_dropout_keeps_no_s_by_s_tensor() -> None:
    _, _, with_dropout = _loss_and_grads(Recompute.NONE, 0.1)
    _, _, without = _loss_and_grads(Recompute.NONE, 0.0)
    # The explicit path would keep (2e + 1) a s^2 b bytes per layer (5 x 4 x 1024^2 x 2 =
    # 40 MiB); the fused kernel keeps its RNG state and the residual dropout's masks only.
    explicit_layer = 5 * CONFIG.n_head * SEQ * SEQ * BATCH
    assert with_dropout - without < explicit_layer / 4, (with_dropout, without)


def test_dropout_draws_and_recomputes_alike() -> None:
    loss, grads, _ = _loss_and_grads(Recompute.NONE, 0.1)
    again, grads_again, _ = _loss_and_grads(Recompute.FULL, 0.1)
    plain, _, _ = _loss_and_grads(Recompute.NONE, 0.0)
    other_seed, _, _ = _loss_and_grads(Recompute.NONE, 0.1, seed=8)
    assert loss == again and loss != plain and loss != other_seed
    for a, b in zip(grads, grads_again, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_batches_reach_the_device_from_pinned_memory() -> None:
    """The profiler's copy events name their source: pinned, not pageable."""
    from torch.profiler import ProfilerActivity, profile

    from launch.train.step import split_batch

    window = torch.randint(0, 128, (4, 65))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        inputs, targets = split_batch(window, torch.device("cuda"))
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.name.startswith("Memcpy HtoD")]
    assert copies and all("Pinned" in name for name in copies), copies
    assert torch.equal(inputs.cpu(), window[:, :-1]) and torch.equal(targets.cpu(), window[:, 1:])
