"""Worker functions for tests/zero/test_grad_reduce.py: one 4-rank job steps a tiny GPT under
every ZeRO stage at tp 1 (dp 4) and tp 2 (dp 2), with bf16 compute and two micro-batches,
in both gradient reduction dtypes, and returns what the reference needs:

- the bf16 (or fp16) gradient autograd gives each parameter in each micro-batch, captured
  by a hook registered before the engine's (so it runs first, on autograd's own tensor);
- the gradient the optimizer steps on, read from the fp32 master views' `.grad` in a
  pre-step hook of the optimizer (after the loss scale is divided out);
- the bucket layout, to place the reference into this rank's shard;
- the bytes the collectives counted and the engine's model-state bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

SEED = 3
MICRO_BATCHES, MICRO_BATCH = 2, 2
CONFIG = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=256)
BUCKET_MB = 0.02  # about 10k bf16 elements: a unit per bucket, so several reductions
LOSS_SCALE = 1024.0  # fp16's initial scale in the fp16 case


def micro_batches(dp_rank: int) -> list[torch.Tensor]:
    """This DP rank's micro-batches of (micro_batch, seq_len + 1) token ids."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    shape = (MICRO_BATCH, CONFIG.seq_len + 1)
    return [torch.randint(0, CONFIG.vocab_size, shape, generator=g) for _ in range(MICRO_BATCHES)]


def one_step(
    topology: Topology, stage: int, grad_reduce_dtype: str, precision: str = "bf16"
) -> dict[str, Any]:
    parallel = TensorParallel.from_topology(topology, SEED)
    model = GPT(CONFIG, parallel, seed=SEED)
    names = {id(p): name for name, p in model.named_parameters()}
    autograd: dict[str, list[torch.Tensor]] = {name: [] for name in names.values()}
    for p in model.parameters():  # before the engine's hooks: sees autograd's gradient
        p.register_post_accumulate_grad_hook(
            lambda param: autograd[names[id(param)]].append(param.grad.detach().clone())
        )
    config = EngineConfig(
        zero_stage=stage,
        precision=precision,
        micro_batches=MICRO_BATCHES,
        bucket_mb=BUCKET_MB,
        grad_reduce_dtype=grad_reduce_dtype,
        initial_loss_scale=LOSS_SCALE,
    )
    engine = Engine(model, topology, parallel, config, units=list(model.blocks))
    stepped: list[torch.Tensor] = []

    def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
        for state in engine.states:
            grads = [view.grad for _, view in state.master_segments]
            stepped.append(torch.cat(grads).clone())

    engine.optimizer.register_step_pre_hook(capture)
    topology.counter.reset()
    for ids in micro_batches(topology.dp_rank):
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    backward_bytes = dict(topology.counter.bytes)
    stats = engine.step(1e-3)
    engine.wait_for_parameters()  # the step's all-gather, issued in part by the next forward
    assert not stats.skipped
    layout = [
        {
            "names": list(b.names),
            "offsets": list(b.offsets),
            "numels": [s.numel() for s in b.shapes],
            "numel": b.numel,
            "shard_start": b.shard_start if stage >= 1 else 0,
            "shard_numel": b.shard_numel if stage >= 1 else b.numel,
        }
        for b in engine.buckets
    ]
    return {
        "stage": stage,
        "tp": topology.tp,
        "dp": topology.dp,
        "dp_rank": topology.dp_rank,
        "tp_rank": topology.tp_rank,
        "grad_reduce_dtype": grad_reduce_dtype,
        "precision": precision,
        "autograd": autograd,
        "stepped": stepped,
        "layout": layout,
        "backward_bytes": {f"{k}/{g}": v for (k, g), v in backward_bytes.items()},
        "step_bytes": {f"{k}/{g}": v for (k, g), v in topology.counter.bytes.items()},
        "states": engine.model_state_bytes(),
    }


def all_steps() -> list[dict[str, Any]]:
    """Every stage at tp 1 and 2 in both reduction dtypes, and fp16 (fp32 reduction) at
    stages 0 and 2, on this rank."""

    def work() -> list[dict[str, Any]]:
        results = []
        for tp in (1, 2):
            topology = Topology.build(tp)
            for stage in (0, 1, 2, 3):
                for dtype in ("fp32", "bf16"):
                    results.append(one_step(topology, stage, dtype))
            if tp == 1:
                for stage in (0, 2):
                    results.append(one_step(topology, stage, "fp32", "fp16"))
        return results

    return in_process_group(work)
