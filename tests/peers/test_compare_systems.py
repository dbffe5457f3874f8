"""The benchmark's plain-PyTorch twin (benchmarks/compare/plain_gpt.py) is our GPT: the same
loss and gradients on the same weights and batch, so the side-by-side comparison cannot
silently measure two different models; and its instruments measure what they say: the
peak over the timed steps above the process's own baseline, model states by role, time
as paired per-round ratios in an evenly alternating order. The benchmark itself is not a
test (too slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` imports

from benchmarks.compare.common import (
    SEED,
    BenchConfig,
    JobSpec,
    global_batches,
    initial_state,
    local_batch,
)
from benchmarks.compare.metrics import CommCounter, PeakMeter, live_tensor_bytes
from benchmarks.compare.plain_gpt import PlainGPT, from_state
from benchmarks.compare.report import (
    Row,
    best_peer,
    checks,
    measurement_problems,
    paired_ratio,
    table,
)
from models.gpt import GPT, GPTConfig

BENCH = BenchConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, global_batch=4, steps=2)
MB = 2**20
# A peak above baseline is at least what was held at once (less what the interpreter may
# free of its baseline, a few MB), and at most that plus the interpreter's own churn
# after the baseline (its first steps, the instruments' scans: 20-30 MB measured).
BELOW, ABOVE = 8 * MB, 48 * MB


def _about(measured: int, held: int) -> bool:
    return held - BELOW <= measured <= held + ABOVE


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

    from hybrid.distributed.env import init_distributed, shutdown

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
    from hybrid.instruments.local_processes import run_processes

    counts = run_processes(_count_collectives, 2)[0]
    assert counts["all_reduce"] == {"all_reduce": 40}
    assert counts["redistribute"] == {"all_gather": 8 * 4 * 4}  # the gathered tensor
    assert counts["ddp"] == {"all_reduce": 4 * 4 * 4}  # one bucket: the weight's gradient


def _row(
    system: str,
    stage: int,
    time_s: float | list[float],
    losses: list[float],
    dp: int = 2,
    peak: int = 100 * MB,
    states: int = 50 * MB,
) -> Row:
    """A configuration's result, one round per step time given."""
    spec = JobSpec(system, dp=dp, stage=stage, bench=BENCH)
    times = time_s if isinstance(time_s, list) else [time_s]
    rounds = []
    for t in times:
        rank = {
            "median_time": t,
            "losses": losses,
            "tp_rank": 0,
            "peak": {"peak_above_baseline": peak, "windowed": True},
            "memory": {"model_states": states, "buffers": 0, "other": 0},
            "comm": {"total_bytes": 1},
        }
        rounds.append([rank, rank])
    return Row(spec, rounds=rounds)


def test_the_floor_is_a_bound_not_a_peer_and_its_losses_are_not_compared() -> None:
    plain = _row("plain", 0, 0.6, [2.0, 1.0], dp=1)
    ours = _row("ours", 0, 0.35, [2.0, 1.0])
    deepspeed = _row("deepspeed", 0, 0.34, [2.0, 1.0])
    floor = _row("floor", 0, 0.30, [2.0, 1.7])  # unsynchronised: another trajectory
    rows = [plain, ours, deepspeed, floor]
    assert best_peer(rows, ours) is deepspeed
    lines = "\n".join(checks(rows))
    loss_line = next(line for line in lines.splitlines() if "losses agree" in line)
    assert loss_line.endswith("| 0.0e+00 | <= 1.0e-05 | PASS |"), loss_line
    assert (
        "| ours stage 0, dp=2 / no-communication floor, time | 1.167 | <= 1.0500 | FAIL |" in lines
    )
    assert (
        "| ours stage 0, dp=2 / DeepSpeed stage 0, dp=2, time | 1.029 | <= 1.0000 | FAIL |" in lines
    )
    floor_line = next(line for line in table(rows) if line.startswith("| floor"))
    assert "(unsynchronised) | n/a" in floor_line


# ---- time: paired ratios, even alternation --------------------------------------------------


def test_time_is_the_median_of_per_round_paired_ratios_with_their_range() -> None:
    # Round 2 and 4 ran under heavy load for both: the ratio of medians (2.1 / 2.0 = 1.05)
    # mixes rounds; the paired ratios are 1.111, 0.9375, 1.2, 1.1.
    ours = _row("ours", 3, [1.0, 3.0, 1.2, 3.3], [2.0, 1.0])
    peer = _row("deepspeed", 3, [0.9, 3.2, 1.0, 3.0], [2.0, 1.0])
    ratio = paired_ratio(ours, peer)
    assert ratio.median == pytest.approx((1.1 + 1.0 / 0.9) / 2)
    assert (ratio.low, ratio.high) == (pytest.approx(0.9375), pytest.approx(1.2))
    assert str(ratio) == "1.106 [0.938-1.200]"
    line = next(line for line in checks([ours, peer]) if "stage 3, dp=2, time" in line)
    assert "| 1.106 [0.938-1.200] | <= 1.0000 | FAIL |" in line


def test_every_pair_runs_in_each_order_equally_often() -> None:
    from benchmarks.compare_systems import SYSTEMS, plan, round_order

    specs = plan(BENCH, [False, True], set(SYSTEMS))
    rounds = [round_order(specs, k) for k in range(4)]
    assert all(sorted(map(id, r)) == sorted(map(id, specs)) for r in rounds)
    for i, a in enumerate(specs):
        for b in specs[i + 1 :]:
            first = sum(r.index(a) < r.index(b) for r in rounds)
            assert first == 2, (a.label, b.label, first)


# ---- memory: the peak over the timed steps above the baseline; states by role ---------------


def _touched(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4)  # written, so resident (torch.empty would not be)


def test_peak_meter_counts_the_window_above_the_baseline_only() -> None:
    meter = PeakMeter(torch.device("cpu"))  # the baseline
    held = _touched(64 * MB)  # built after the baseline, alive through the window: counted
    before = _touched(256 * MB)  # a set-up transient, freed before the window: not counted
    del before
    meter.start()
    during = _touched(96 * MB)  # a transient inside the window: counted
    del during
    figures = meter.stop()
    assert figures["windowed"], "this test needs /proc/self/clear_refs (Linux)"
    assert _about(figures["peak_above_baseline"], 64 * MB + 96 * MB), figures
    del held


class _FakeTrainer:
    """A system holding 128 MB of parameters, with a 256 MB transient in its warm-up steps
    and a 48 MB one in every later step."""

    dp_rank = tp_rank = 0

    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        self.weight = _touched(128 * MB)
        self.steps = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        transient = _touched((256 if self.steps < BENCH.warmup else 48) * MB)
        return transient[:1].sum()

    def backward(self, loss: torch.Tensor) -> None:
        pass

    def optimizer_step(self) -> None:
        self.steps += 1

    def tensor_roles(self) -> dict[str, list[torch.Tensor]]:
        return {"parameters": [self.weight]}

    def reported(self) -> dict:
        return {}


def test_train_takes_the_peak_over_the_timed_steps_only() -> None:
    from benchmarks.compare.common import train

    meter = PeakMeter(torch.device("cpu"))
    trainer = _FakeTrainer(JobSpec("plain", bench=BENCH), torch.device("cpu"))
    batches = [local_batch(b, 0, 1) for b in global_batches(BENCH)]
    result = train(trainer, batches, BENCH.warmup, meter)
    assert len(result["times"]) == BENCH.steps
    assert result["memory"]["parameters"] == 128 * MB
    assert result["memory"]["model_states"] == 128 * MB
    # The held parameters plus the timed steps' transient; not the warm-up's 256 MB.
    assert _about(result["peak"]["peak_above_baseline"], (128 + 48) * MB), result["peak"]


def _worker_with_fake_system(out: str) -> dict:
    """benchmarks.compare.worker.run on a fake system, as a torchrun rank would."""
    from pathlib import Path

    from benchmarks.compare import worker

    worker.trainer_class_of = lambda system: _FakeTrainer
    result = worker.run(JobSpec("plain", bench=BENCH), Path(out))
    return {"peak": result["peak"]["peak_above_baseline"], "memory": result["memory"]}


def test_worker_reads_the_baseline_before_the_system_is_built(tmp_path: Path) -> None:
    from hybrid.instruments.local_processes import run_processes

    result = run_processes(_worker_with_fake_system, 1, str(tmp_path))[0]
    # The 128 MB the system built are above the baseline; so is the timed steps' 48 MB.
    assert _about(result["peak"], (128 + 48) * MB), result
    assert result["memory"]["model_states"] == 128 * MB


def test_model_states_by_role_each_storage_once() -> None:
    weight = torch.nn.Parameter(torch.ones(1024, 256))  # 1 MB
    view = weight.data[:10]  # the same storage: counted once
    weight.grad = torch.ones(1024, 256)
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    optimizer.step()  # two moments, 1 MB each
    shard = torch.ones(128 * 1024)  # a gradient shard a system keeps itself: 0.5 MB
    bucket = torch.ones(512 * 1024)  # a preallocated communication buffer: 2 MB
    stray = torch.ones(256 * 1024)  # anything else alive: 1 MB
    roles = {"parameters": [weight, view], "gradients": [shard], "buffers": [bucket]}
    found = live_tensor_bytes(roles, exclude=[])
    assert found["parameters"] == 1 * MB
    assert found["gradients"] == 1 * MB + MB // 2
    assert 0 <= found["optimizer"] - 2 * MB <= 8  # and AdamW's scalar `step`
    assert found["buffers"] == 2 * MB
    assert found["model_states"] == found["optimizer"] + 2 * MB + MB // 2
    assert found["other"] >= 1 * MB  # the stray tensor (and whatever else the test holds)
    del stray


def test_the_report_flags_a_peak_below_the_model_states() -> None:
    # A baseline read after the model was built gives this: the states are resident all
    # through the timed steps, so the peak above baseline cannot be below them.
    good = _row("ours", 0, 0.35, [2.0, 1.0], peak=120 * MB, states=50 * MB)
    wrong = _row("deepspeed", 0, 0.34, [2.0, 1.0], peak=30 * MB, states=50 * MB)
    assert measurement_problems([good]) == []
    assert len(measurement_problems([good, wrong])) == 1
    lines = checks([good, wrong])
    assert any("FAIL" in line and "peak >= model states" in line for line in lines)
    # ...and no peak is compared on such figures.
    assert not any(
        line.endswith(("peak above baseline | PASS |", "peak above baseline | FAIL |"))
        or ", peak above baseline |" in line
        for line in lines
    )


def test_bf16_pairs_follow_a_timed_matmul_not_the_cpus_name(monkeypatch) -> None:
    """Where the probe reports emulated bf16 (AVX2 only: ~1/60 of fp32), the bf16 pairs are
    absent and the report says why with the measured rates; where it reports native
    kernels, it says how to run them."""
    import benchmarks.compare_systems as compare
    import launch.observe.matmul_rate as rate

    assert rate.matmul_gflops(torch.float32, size=64) > 0.0  # the real probe, unpatched
    speeds = {torch.bfloat16: 0.8, torch.float32: 50.0}
    monkeypatch.setattr(rate, "matmul_gflops", lambda dtype, device="cpu", size=256: speeds[dtype])
    monkeypatch.setattr(compare, "native_bf16", rate.native_bf16)
    line = compare.bf16_line(BENCH)
    assert "absent" in line and "0.8 GFLOP/s" in line and "50.0 GFLOP/s" in line
    speeds[torch.bfloat16] = 120.0
    assert "--precision bf16" in compare.bf16_line(BENCH)
    assert rate.native_bf16()[0]
