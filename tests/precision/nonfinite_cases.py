"""Worker for tests/precision/test_nonfinite_skip.py: a NaN loss or an inf gradient on one rank at
dp 2; the engine must skip that step on every rank without touching any state.

Each case trains STEPS steps twice on the same rank: once with the fault injected at
BAD_STEP on rank 1 only, once ("clean") on the same batches without BAD_STEP's, as a
run that never saw that batch. Dropout is 0, so the skipped step consumes no random
numbers and the two runs must agree bit for bit afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

SEED = 4
STEPS, BAD_STEP = 5, 2
BAD_RANK = 1
GLOBAL_BATCH, MICRO_BATCHES = 8, 2
CONFIG = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=16, vocab_size=256)
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 1.0
FAULTS = ("nan_loss", "inf_grad")


@dataclass(frozen=True)
class Case:
    stage: int
    precision: str  # bf16: the fp32 masters are tensors of their own, checked too


CASES = [Case(stage, "fp32") for stage in range(4)] + [Case(1, "bf16"), Case(3, "bf16")]


def global_batches() -> list[torch.Tensor]:
    """Counting sequences from random starts, one global batch per step."""
    g = torch.Generator().manual_seed(23)
    steps = torch.arange(CONFIG.seq_len + 1)
    return [
        (torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g) + steps)
        % CONFIG.vocab_size
        for _ in range(STEPS)
    ]


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    """Every state tensor this rank keeps across steps, copied: per bucket its parameters
    (the full flat buffer at stages 0-2, the shard at 3), the fp32 master shard and Adam's
    moments, and each Adam step counter."""
    engine.wait_for_parameters()  # the last step's all-gathers (stages 1-2) have landed
    out = {}
    for k, state in enumerate(engine.states):
        out[f"bucket{k}.params"] = state.param_storage.clone()
        out[f"bucket{k}.master"] = state.master.clone()
        out[f"bucket{k}.exp_avg"] = state.exp_avg.clone()
        out[f"bucket{k}.exp_avg_sq"] = state.exp_avg_sq.clone()
    for i, adam in enumerate(engine.optimizer.state.values()):
        out[f"adam{i}.step"] = adam["step"].clone()
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Per tensor: the same bytes (not only equal values: -0.0 is not 0.0, NaN is NaN)."""
    assert a.keys() == b.keys()
    return {key: _bytes(a[key]).equal(_bytes(b[key])) for key in a}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def inf_gradient(param: torch.nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook that makes one element of `param`'s gradient +inf."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    return hook


def train(topology: Topology, case: Case, fault: str | None) -> dict[str, Any]:
    """STEPS steps with `fault` on BAD_RANK at BAD_STEP, or (fault None) the clean run
    that skips BAD_STEP's batch. Returns per-step losses, norms and skip flags, which
    state tensors kept their bits over the faulty step and changed over a normal one,
    and the final state."""
    parallel = TensorParallel.from_topology(topology, SEED)
    model = GPT(CONFIG, parallel, seed=SEED)
    config = EngineConfig(
        zero_stage=case.stage,
        precision=case.precision,
        micro_batches=MICRO_BATCHES,
        grad_clip=CLIP,
        weight_decay=WEIGHT_DECAY,
    )
    engine = Engine(model, topology, parallel, config, units=list(model.blocks))
    per_rank = GLOBAL_BATCH // topology.dp
    losses, norms, skipped = [], [], []
    unchanged: dict[str, bool] = {}
    changed: dict[str, bool] = {}
    for step, batch in enumerate(global_batches()):
        if fault is None and step == BAD_STEP:
            continue
        poisoned = fault is not None and step == BAD_STEP and topology.dp_rank == BAD_RANK
        hook = None
        if poisoned and fault == "inf_grad":
            hook = model.blocks[1].mlp.fc.weight.register_hook(
                inf_gradient(model.blocks[1].mlp.fc.weight)
            )
        before = snapshot(engine)
        mine = batch[topology.dp_rank * per_rank : (topology.dp_rank + 1) * per_rank]
        total = torch.zeros(())
        for i, micro in enumerate(mine.chunk(MICRO_BATCHES)):
            loss = engine(micro[:, :-1], micro[:, 1:])
            if poisoned and fault == "nan_loss" and i == 0:
                loss = loss * float("nan")
            engine.backward(loss)
            total += loss.detach().float() / MICRO_BATCHES
        stats = engine.step(LR)
        if hook is not None:
            hook.remove()
        losses.append(float(topology.dp_group.all_reduce(total) / topology.dp))
        norms.append(stats.grad_norm)
        skipped.append(stats.skipped)
        if fault is not None and step == BAD_STEP:
            unchanged = same_bits(before, snapshot(engine))
        if step == BAD_STEP + 1:  # a normal step changes every kind of state
            changed = {k: not same for k, same in same_bits(before, snapshot(engine)).items()}
    return {
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "unchanged": unchanged,
        "changed": changed,
        "adam_steps": engine.adam_steps,
        "final": snapshot(engine),
    }


def all_cases() -> list[dict[str, Any]]:
    """On each of 2 ranks (dp 2): every case clean and with each fault. The final states
    are compared here, rank by rank, so only their verdicts travel."""

    def work() -> list[dict[str, Any]]:
        topology = Topology.build(1)
        results = []
        for case in CASES:
            clean = train(topology, case, None)
            final = clean.pop("final")
            for fault in FAULTS:
                faulty = train(topology, case, fault)
                faulty["final_as_clean"] = same_bits(faulty.pop("final"), final)
                results.append({"case": vars(case), "fault": fault, "run": faulty, "clean": clean})
        return results

    return in_process_group(work)
