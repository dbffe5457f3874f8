"""Ours holds no more than a plain PyTorch loop on the same model, measured from outside.

The benchmark's adapters (benchmarks/compare: our Engine at stage 0, and the plain twin
with torch AdamW and `zero_grad(set_to_none=True)`), the same tiny GPT, weights and
batches. After two warm-up steps, one step of each runs under torch's MemTracker
(benchmarks/compare/breakdown.py: the peak by phase, every storage the adapter names filed
by its role), so the figures are the tracker's, not the engine's:
- one process: ours steps on autograd's own gradients (nothing to reduce), so its peak is
  at most the plain loop's, with no allowance (measured: 5.07 vs 5.20 MB);
- dp=2 (each rank against the plain loop on its half batch, the no-communication floor):
  the step's peak at most the loop's plus one bucket's gradient buffer (a bucket's buffer
  is allocated whole at its first gradient, where autograd allocates one parameter's);
- forward, both: no gradient of ours is alive (the loop has none: set_to_none), so the
  forward peak is the loop's.
Buckets are one layer each here (a small `bucket_mb`), so keeping the gradients through
forward (four layers' worth) exceeds the one-bucket allowance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` imports

from benchmarks.compare.breakdown import breakdown_step
from benchmarks.compare.common import (
    BenchConfig,
    JobSpec,
    forward_backward,
    global_batches,
    local_batch,
)
from benchmarks.compare.peers.ours import OursTrainer
from benchmarks.compare.peers.plain import PlainTrainer

BENCH = BenchConfig(
    n_layer=4, n_head=4, d_model=64, seq_len=32, global_batch=4, steps=1, bucket_mb=0.1
)


def _measured(system: str, dp: int = 1, dp_rank: int = 0) -> tuple[dict, object]:
    torch.manual_seed(0)
    spec = JobSpec(system, dp=dp if system == "ours" else 1, bench=BENCH)
    trainer = (OursTrainer if system == "ours" else PlainTrainer)(spec, torch.device("cpu"))
    batches = [local_batch(b, dp_rank, dp) for b in global_batches(BENCH)]
    for x, y in batches[: BENCH.warmup]:
        forward_backward(trainer, x, y)
        trainer.optimizer_step()
    return breakdown_step(trainer, *batches[BENCH.warmup]), trainer


def _ours_then_plain(dp: int) -> dict:
    """On this rank: ours at `dp`, then (nothing of ours alive) the plain loop on the same
    local batches."""
    from hybrid.distributed.env import init_distributed, shutdown

    env = init_distributed()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours, trainer = _measured("ours", dp, env.rank)
        states = trainer.engine.states
        element = torch.finfo(trainer.engine.grad_dtype).bits // 8
        bucket = max(s.param_storage.numel() * element for s in states)
        buckets = len(states)
        del trainer, states  # nothing of ours is alive while the plain loop is measured
        plain, _ = _measured("plain", dp, env.rank)
    finally:
        torch.set_num_threads(previous)
        shutdown(env)
    return {"ours": ours, "plain": plain, "bucket": bucket, "buckets": buckets}


@pytest.fixture(scope="module", params=[1, 2], ids=["1 process", "dp=2"])
def measured(request: pytest.FixtureRequest) -> dict:
    from hybrid.instruments.local_processes import run_processes

    if request.param == 1:
        return _ours_then_plain(1) | {"dp": 1}
    ranks = run_processes(_ours_then_plain, 2, 2)
    return max(ranks, key=lambda r: r["ours"]["peak"]["total"]) | {"dp": 2}


def test_peak_step_memory_is_the_plain_loops(measured: dict) -> None:
    assert measured["buckets"] == 1 + BENCH.n_layer  # one bucket a layer, and the root's
    ours, plain = measured["ours"]["peak"]["total"], measured["plain"]["peak"]["total"]
    allowance = 0 if measured["dp"] == 1 else measured["bucket"]
    assert ours <= plain + allowance, (
        f"ours {ours} B > plain {plain} B + {allowance} B",
        measured["ours"],
        measured["plain"],
    )


def test_no_gradient_is_alive_during_forward(measured: dict) -> None:
    ours = measured["ours"]["phases"]["forward"]
    plain = measured["plain"]["phases"]["forward"]
    assert plain["gradients"] == 0, plain
    assert ours["gradients"] == 0, ours
    # The tracker's total too, whatever the labels: within 1% of the plain loop's.
    assert ours["total"] <= 1.01 * plain["total"], (ours, plain)
