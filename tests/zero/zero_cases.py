"""Worker functions for the ZeRO engine tests."""

from __future__ import annotations

from typing import Any

import torch
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

SEED = 3
STEPS = 20
GLOBAL_BATCH, MICRO = 8, 2
CONFIG = GPTConfig(n_layer=3, n_head=4, d_model=32, seq_len=16, vocab_size=200)
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.1, 0.5


def global_batches() -> list[torch.Tensor]:
    """Counting sequences from random starts: learnable, so the losses move."""
    g = torch.Generator().manual_seed(9)
    steps = torch.arange(CONFIG.seq_len + 1)
    return [
        (torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g) + steps)
        % CONFIG.vocab_size
        for _ in range(STEPS)
    ]


def reference_losses() -> list[float]:
    """Single process, plain torch.optim.AdamW, gradient accumulation, clipping."""
    model = GPT(CONFIG, seed=SEED)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    losses = []
    for batch in global_batches():
        total = 0.0
        for micro in batch.split(MICRO):
            loss = model(micro[:, :-1], micro[:, 1:]) / (GLOBAL_BATCH // MICRO)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def engine_losses(
    stage: int,
    tp: int,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bucket_mb: float = 25.0,
) -> list[float]:
    def work() -> list[float]:
        topology = Topology.build(tp)
        parallel = TensorParallel.from_topology(topology, SEED, sequence_parallel)
        model = GPT(CONFIG, parallel, RecomputePolicy(Recompute(recompute)), seed=SEED)
        per_rank = GLOBAL_BATCH // topology.dp
        config = EngineConfig(
            zero_stage=stage,
            micro_batches=per_rank // MICRO,
            grad_clip=CLIP,
            weight_decay=WEIGHT_DECAY,
            bucket_mb=bucket_mb,
        )
        engine = Engine(model, topology, parallel, config, units=list(model.blocks))
        if bucket_mb < 0.5 and stage < 3:  # units of ~50 kB: buckets of 2 units, then 1
            assert [len(b.params) for b in engine.buckets] == [4, 24, 12]
        losses = []
        for batch in global_batches():
            mine = batch[topology.dp_rank * per_rank : (topology.dp_rank + 1) * per_rank]
            total = torch.zeros(())
            for micro in mine.split(MICRO):
                loss = engine(micro[:, :-1], micro[:, 1:])
                engine.backward(loss)
                total += loss.detach() / config.micro_batches
            engine.step(LR)
            losses.append(float(topology.dp_group.all_reduce(total) / topology.dp))
        return losses

    return in_process_group(work)


def fp16_overflow() -> list[dict[str, Any]]:
    """fp16 at dp=2, stage 2: rank 1's loss becomes inf at step 2 only; every rank must skip
    that step and halve the loss scale, and train normally before and after."""

    def work() -> list[dict[str, Any]]:
        topology = Topology.build(1)
        parallel = TensorParallel.from_topology(topology, SEED)
        model = GPT(CONFIG, parallel, seed=SEED)
        engine = Engine(
            model,
            topology,
            parallel,
            EngineConfig(zero_stage=2, precision="fp16", initial_loss_scale=1024.0),
            units=list(model.blocks),
        )
        records = []
        for step, batch in enumerate(global_batches()[:4]):
            mine = batch[topology.dp_rank * 4 : (topology.dp_rank + 1) * 4]
            loss = engine(mine[:, :-1], mine[:, 1:])
            if step == 2 and topology.dp_rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            before = model.blocks[0].mlp.fc.weight.detach().clone()
            stats = engine.step(LR)
            engine.wait_for_parameters()  # read outside forward: the gathers must end first
            changed = not torch.equal(before, model.blocks[0].mlp.fc.weight.detach())
            records.append(
                {"skipped": stats.skipped, "scale": stats.loss_scale, "changed": changed}
            )
        return records

    return in_process_group(work)


def meta_stage3_weights(config: GPTConfig, seed: int) -> dict[str, Any]:
    """tp=2 x dp=2: a GPT built on meta, materialised by a stage-3 Engine. Returns the
    gathered full weights, the parameter elements this rank holds (counted from the
    storages, not from the engine's bookkeeping) and the random values it drew (every
    request to the seeded generator, counted from outside)."""
    from unittest import mock

    from hybrid.tensor_parallel import shards

    def held_elements(engine: Engine, model: GPT) -> int:
        """Elements in the distinct storages behind the parameter shards and the parameters
        (a freed stage-3 bucket's storage has 0 bytes; its parameters still have shapes)."""
        tensors = [s.param_storage for s in engine.states] + list(model.parameters())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
        return sum(s.nbytes() for ptr, s in storages.items() if ptr) // 4  # fp32

    def work() -> dict[str, Any]:
        topology = Topology.build(2)
        parallel = TensorParallel.from_topology(topology, seed)
        model = GPT(config, parallel, seed=seed, device="meta")
        # The attribute every seeded initialisation calls (GPT.initial_values -> shards).
        with mock.patch.object(shards, "seeded_normal", wraps=shards.seeded_normal) as draw:
            engine = Engine(
                model, topology, parallel, EngineConfig(zero_stage=3), list(model.blocks)
            )
        drawn = sum(call.args[2].numel() for call in draw.call_args_list)
        held = held_elements(engine, model)
        return {"weights": engine.full_state_dict(), "held": held, "drawn": drawn}

    return in_process_group(work)
