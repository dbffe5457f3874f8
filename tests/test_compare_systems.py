"""The benchmark's plain-PyTorch twin (benchmarks/compare/plain_gpt.py) is our GPT: the same
loss and gradients on the same weights and batch, so the side-by-side comparison cannot
silently measure two different models. The benchmark itself is not a test (too slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` imports

from benchmarks.compare.common import (
    SEED,
    BenchConfig,
    JobSpec,
    global_batches,
    initial_state,
    local_batch,
)
from benchmarks.compare.metrics import CommCounter
from benchmarks.compare.plain_gpt import PlainGPT, from_state
from benchmarks.compare.report import Row, acceptance, best_peer, table
from models.gpt import GPT, GPTConfig

BENCH = BenchConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, global_batch=4, steps=2)


@pytest.mark.parametrize("recompute", [False, True])
def test_twin_matches_our_gpt(recompute: bool) -> None:
    config = BENCH.gpt_config()
    ours = GPT(config, seed=SEED)
    twin = from_state(config, initial_state(BENCH), recompute=recompute)
    for batch in global_batches(BENCH):
        x, y = local_batch(batch, 0, 1)
        ours.zero_grad()
        twin.zero_grad()
        ours_loss, twin_loss = ours(x, y), twin(x, y)
        assert twin_loss.item() == pytest.approx(ours_loss.item(), rel=1e-5)
        ours_loss.backward()
        twin_loss.backward()
        ours_grads = dict(ours.named_parameters())
        for name, param in twin.named_parameters():
            expected = ours_grads[name].grad
            scale = expected.abs().max()
            assert (param.grad - expected).abs().max() <= 1e-5 * scale, name


def test_twin_takes_exactly_our_parameter_names() -> None:
    config = BENCH.gpt_config()
    ours = {n: tuple(p.shape) for n, p in GPT(config, seed=SEED).named_parameters()}
    twin = {n: tuple(p.shape) for n, p in PlainGPT(config).named_parameters()}
    assert twin == ours


def test_twin_refuses_options_it_does_not_implement() -> None:
    with pytest.raises(ValueError, match="rmsnorm|norm"):
        PlainGPT(
            GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=32, norm="rmsnorm")
        )


def test_batches_are_the_same_for_every_dp_split() -> None:
    batch = global_batches(BENCH)[0]
    x, y = local_batch(batch, 0, 1)
    halves = [local_batch(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x)
    assert torch.equal(torch.cat([h[1] for h in halves]), y)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_comm_counter_sees_no_collective_in_one_process() -> None:
    with CommCounter() as counter:
        twin = from_state(BENCH.gpt_config(), initial_state(BENCH))
        x, y = local_batch(global_batches(BENCH)[0], 0, 1)
        twin(x, y).backward()
    assert counter.summary()["total_bytes"] == 0


def _count_collectives() -> dict:
    """On each of 2 gloo ranks: an all-reduce, a DTensor redistribution (functional
    collective) and a DDP backward (C++ reducer), each counted by the benchmark's counter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    from hybrid.distributed import init_distributed, shutdown

    env = init_distributed()
    try:
        mesh = init_device_mesh("cpu", (2,))
        sharded = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4, bias=False))
        counts = {}
        for name, work in [
            ("all_reduce", lambda: dist.all_reduce(torch.ones(10))),
            ("redistribute", lambda: sharded.redistribute(mesh, [Replicate()]).to_local()),
            ("ddp", lambda: ddp(torch.ones(2, 4)).sum().backward()),
        ]:
            with CommCounter() as counter:
                work()
            counts[name] = counter.summary()["bytes"]
        return counts
    finally:
        shutdown(env)


def test_comm_counter_sees_every_path_to_a_process_group() -> None:
    from hybrid.testing import run_processes

    counts = run_processes(_count_collectives, 2)[0]
    assert counts["all_reduce"] == {"all_reduce": 40}
    assert counts["redistribute"] == {"all_gather": 8 * 4 * 4}  # the gathered tensor
    assert counts["ddp"] == {"all_reduce": 4 * 4 * 4}  # one bucket: the weight's gradient


def _row(system: str, stage: int, time_s: float, losses: list[float], dp: int = 2) -> Row:
    spec = JobSpec(system, dp=dp, stage=stage, bench=BENCH)
    rank = {
        "median_time": time_s,
        "losses": losses,
        "tp_rank": 0,
        "peak_rss": 1,
        "memory": {"total": 1},
        "comm": {"total_bytes": 1},
    }
    return Row(spec, rounds=[[rank, rank]])


def test_the_floor_is_a_bound_not_a_peer_and_its_losses_are_not_compared() -> None:
    plain = _row("plain", 0, 0.6, [2.0, 1.0], dp=1)
    ours = _row("ours", 0, 0.35, [2.0, 1.0])
    deepspeed = _row("deepspeed", 0, 0.34, [2.0, 1.0])
    floor = _row("floor", 0, 0.30, [2.0, 1.7])  # unsynchronised: another trajectory
    rows = [plain, ours, deepspeed, floor]
    assert best_peer(rows, ours) is deepspeed
    checks = "\n".join(acceptance(rows))
    loss_line = next(line for line in checks.splitlines() if "losses agree" in line)
    assert loss_line.endswith("| 0.0e+00 | <= 1.0e-05 | PASS |"), loss_line
    assert "no-communication floor / DeepSpeed stage 0 | 0.8824" in checks
    assert "| ours / DeepSpeed stage 0, time | 1.0294 | <= 0.9000 | FAIL |" in checks
    floor_line = next(line for line in table(rows) if line.startswith("| floor"))
    assert "(unsynchronised) | n/a" in floor_line
