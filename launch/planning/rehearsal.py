"""One real rank of a large job, run on this machine and held against the planner.

The rest of the job is torch's fake process group (hybrid.instruments.fake_world): this process is
rank R of a world of N, with the topology, the shards, the buckets and the kernels that
rank would have, and collectives that return at once. It builds the model on the meta
device and lets the Engine materialise only rank R's shards, then runs training steps of
the real engine (launch.train.step.train_step) on synthetic tokens. Measured, each by an
instrument outside the code under test:
- memory by category at the step's peak: torch's MemTracker, the engine's storages filed
  by what they are (hybrid.instruments.engine_memory); on CUDA also the allocator's peak;
- the FLOPs executed: torch's FLOP formulas, counted at its dispatcher; the step's wall
  time, without instruments;
- the bytes each collective would have moved: counted at torch's dispatcher
  (hybrid.instruments.dispatch_counters), next to the library's own CollectiveCounter.
The first step runs under the instruments; later ones are timed bare. The step's window
is a whole cycle of collectives: at stages 1-2 the parameter all-gathers the step issues
and the next forward would wait for (overlap_param_gather) are waited for inside it.

Two modes of compute, the same code path and categories: `fake` (the default of
launch.rehearse) runs every op under torch's FakeTensorMode (hybrid.instruments.fake_compute):
the allocations, FLOPs and collectives of the real run in seconds on any CPU, and no time;
`real` runs the kernels, for the step's time and FLOP rate.

Initial values are drawn with torch's generator, from the same distributions as GPT-2's
initialisation, rather than the counter-based stream of a real run (which gives the same
weights at any layout, at ~130 ns an element: about 5 minutes for one 17B rank's TP slice
on two cores). Memory and speed do not depend on the values, only on their being finite
and of the right scale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
import warnings
from contextlib import nullcontext
from typing import Any

import torch

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine
from hybrid.instruments.dispatch_counters import CollectiveTrace, FlopCount
from hybrid.instruments.engine_memory import EngineMemoryTracker
from hybrid.instruments.fake_compute import FakeAnswers, fake_compute
from hybrid.instruments.fake_world import fake_world
from hybrid.memory import Plan
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from launch.config import Config, ConfigError, validate_layout
from launch.planning.memory_check import format_bytes
from launch.planning.rehearsal_report import compare
from launch.planning.rehearsal_request import (
    RESERVE,
    RehearsalError,
    Request,
    model_config,
    planned,
    with_layers,
)
from launch.train.setup import engine_config
from launch.train.step import split_batch, train_step
from models.gpt import GPT


class RehearsalGPT(GPT):
    """The GPT whose meta parameters are materialised from torch's generator (see the
    module docstring); everything else is the model's own."""

    def initial_values(self, name: str, start: int, end: int) -> torch.Tensor:
        param = self.get_parameter(name)
        fill, std = self._init_rule(name, tuple(param.shape))
        out = torch.full((end - start,), float(fill))
        if std:
            key = hashlib.sha256(f"{self.seed}:{name}:{start}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
            out.add_(torch.randn(end - start, generator=generator), alpha=std)
        return out.to(param.dtype)


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes this machine can give the rehearsal now, and where the figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable of this machine"
    raise RehearsalError("cannot read this machine's free memory; give --memory-limit")


def check(request: Request, device: torch.device) -> Plan:
    """Every refusal, before anything is allocated: a rank outside the world, a world not
    divisible by tp (or a batch not divisible by micro-batch x dp), a layout the planner
    says does not fit this machine's memory. Returns the plan."""
    if request.steps < 1:
        raise RehearsalError(f"--steps {request.steps} must be at least 1")
    if not 0 <= request.rank < request.world:
        raise RehearsalError(
            f"--rank {request.rank} is outside a world of {request.world} ranks "
            f"(0..{request.world - 1})"
        )
    try:
        validate_layout(request.config, request.world)
    except ConfigError as error:
        raise RehearsalError(f"{error} (--world {request.world})") from None
    try:
        plan = planned(request, device_type=device.type)
    except ValueError as error:
        raise RehearsalError(str(error)) from None
    if request.compute == "fake":  # nothing is allocated: only the layout must be valid
        return plan
    limit, source = (request.memory_limit, "--memory-limit")
    if limit is None:
        limit, source = free_memory(device)
    need = (plan.memory["peak"] or 0.0) + RESERVE
    if need > limit:
        raise RehearsalError(
            f"rank {request.rank}'s planned peak, {format_bytes(need - RESERVE)} (+ "
            f"{format_bytes(RESERVE)} for the process), exceeds the {format_bytes(limit)} "
            f"{source}; {fitting_layers_hint(request, limit, device.type)}"
        )
    return plan


def fitting_layers_hint(request: Request, limit: int, device_type: str = "cpu") -> str:
    """The most layers that fit, for --layers, or the advice that none does."""
    n = request.config.model.n_layer
    for layers in range(n - 1, 0, -1):
        smaller = dataclasses.replace(request, config=with_layers(request.config, layers))
        if (planned(smaller, device_type=device_type).memory["peak"] or 0.0) + RESERVE <= limit:
            return f"rehearse --layers {layers} (of {n}), or a layout with less per rank"
    return "even one layer does not fit: choose a layout with less per rank"


def rehearse(request: Request, device: torch.device) -> dict[str, Any]:
    """Check, then run the rehearsal and compare it with the planner (see the module
    docstring); the report as a dict (launch.rehearse prints it)."""
    plan = check(request, device)
    with fake_world(request.world, request.rank):
        topology = Topology.build(request.config.parallel.tp, device.type)
        measured = measure(request.config, topology, device, request.steps, request.compute)
    return compare(request, plan, measured, device)


def measure(
    config: Config,
    topology: Topology,
    device: torch.device,
    steps: int = 2,
    compute: str = "real",
) -> dict[str, Any]:
    """Build this rank's model and Engine under the instruments and run `steps` training
    steps: the first instrumented, the others timed (`compute="fake"`: the first only, and
    no time). The topology may be a fake world's (a rehearsal) or a real job's (tests
    compare the two)."""
    if compute not in ("real", "fake"):
        raise ValueError(f"compute must be 'real' or 'fake', not {compute!r}")
    with fake_compute() if compute == "fake" else nullcontext():
        return _measure(config, topology, device, steps, compute == "fake")


def _measure(
    config: Config, topology: Topology, device: torch.device, steps: int, fake: bool
) -> dict[str, Any]:
    t, p = config.train, config.parallel
    cuda = device.type == "cuda" and not fake
    model_cfg, real_tokens = model_config(config)
    window = t.seq_len or model_cfg.seq_len
    tp = TensorParallel.from_topology(topology, t.seed, p.sequence_parallel, device)
    recompute = RecomputePolicy(Recompute(p.recompute), p.recompute_every)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device)
    tracker = EngineMemoryTracker(module_peaks=False)
    started = time.perf_counter()
    with tracker, FakeAnswers() if fake else nullcontext():  # (above the instruments)
        model = RehearsalGPT(
            model_cfg, tp, recompute, t.seed, n_real_tokens=real_tokens, device="meta"
        )
        engine = Engine(
            model, topology, tp, engine_config(config, topology.dp), list(model.blocks), device
        )
    build_s = time.perf_counter() - started
    tracker.follow(engine)
    built = tracker.categories("current")
    generator = torch.Generator().manual_seed(t.seed + topology.dp_rank)

    def batch() -> list[torch.Tensor]:
        shape = (t.micro_batch_size, window + 1)
        return [
            torch.randint(0, real_tokens, shape, generator=generator)
            for _ in range(engine.config.micro_batches)
        ]

    names = {
        g.process_group.group_name: g.name
        for g in (topology.tp_group, topology.dp_group)
        if g.process_group is not None
    }
    trace = CollectiveTrace(names)
    flops = FlopCount()
    topology.counter.reset()
    answers = FakeAnswers() if fake else nullcontext()  # above the instruments
    with tracker, flops, trace, answers, warnings.catch_warnings():
        # (Entering resets the tracker's peak to what is held now.) MemTracker's gradient
        # hook also fires for parameters whose gradient the engine's hook has taken.
        warnings.filterwarnings("ignore", message="Expected a tensor")
        tick = time.perf_counter()
        # launch.train.step.train_step, with a look at the model states after backward.
        for inputs, targets in (split_batch(micro, device) for micro in batch()):
            tracker.reset_mod_stats()  # MemTracker follows one pass of a module per reset
            engine.backward(engine(inputs, targets))
        after_backward = tracker.categories("current")
        engine.step(t.lr)
        # The step's gathers still queued or in flight (stages 1-2, overlap_param_gather):
        # the next forward would wait for them; here, so the window holds a whole cycle.
        engine.wait_for_parameters()
        if cuda:
            torch.cuda.synchronize(device)
        first_s = time.perf_counter() - tick
    peak = tracker.categories("peak")
    counter = {f"{kind} {group}": n for (kind, group), n in topology.counter.bytes.items()}
    allocator = None
    if cuda:
        torch.cuda.synchronize(device)
        allocator = torch.cuda.max_memory_allocated(device) - allocated
    times = []
    for _ in range(0 if fake else steps - 1):  # fake compute has no time to measure
        tick = time.perf_counter()
        train_step(engine, batch(), t.lr, device)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - tick)
    return {
        "topology": {
            "world": topology.world_size,
            "tp": topology.tp,
            "dp": topology.dp,
            "tp_rank": topology.tp_rank,
            "dp_rank": topology.dp_rank,
        },
        "build_s": build_s,
        "built": built,
        "after_backward": after_backward,
        "peak": peak,
        "allocator_peak": allocator,
        "first_step_s": first_s,
        "compute": "fake" if fake else "real",
        "step_s": None if fake else statistics.median(times) if times else first_s,
        "timed_steps": len(times),
        "counted_flops": flops.flops,
        "collectives": {
            f"{kind} {group}": {
                "calls": trace.calls[kind, group],
                "bytes": trace.bytes[kind, group],
            }
            for kind, group in trace.calls
        },
        "sent": trace.sent_by_group(),
        "counter_bytes": counter,
    }
