"""Our parallel Linears' weight gradients written by their backward straight into the
engine's buckets (hybrid.tensor_parallel.weight_grads): autograd's gradients to fp32
rounding, over micro-batches and under recomputation; no autograd gradient made for those
weights; a gradient hook on a weight still sees and changes its gradient; a weight also
used outside its layer refused with an error, not summed wrong; a weight two layers share
left to autograd, which sums its uses.

Tolerance: 1e-6 absolute, 1e-5 relative (fp32). The same products are summed in another
order (a micro-batch's product added into the buffer by the matmul, against autograd's
two gradients added after), which moves the last bits only; a lost micro-batch, a
transposed or misplaced gradient moves them by the gradient's own size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=64)
LINEAR_WEIGHTS = {"attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"}


def _micro_batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (2, CONFIG.seq_len + 1)
    return [torch.randint(0, CONFIG.vocab_size, shape, generator=g) for _ in range(count)]


def _engine(model: nn.Module, parallel: TensorParallel, stage: int, micro: int) -> Engine:
    config = EngineConfig(zero_stage=stage, micro_batches=micro)
    units = list(getattr(model, "blocks", []))
    return Engine(model, Topology.build(1), parallel, config, units=units)


def _stepped_gradients(engine: Engine) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as the optimizer gets it (dp = 1: the shard is the whole
    flat range), read in a pre-step hook."""
    found: dict[str, torch.Tensor] = {}

    def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
        for bucket, state in zip(engine.buckets, engine.states, strict=True):
            flat = torch.cat([view.grad for _, view in state.master_segments])
            for i, name in enumerate(bucket.names):
                found[name] = bucket.view(flat, i).clone()

    engine.optimizer.register_step_pre_hook(capture)
    engine.step(1e-3)
    return found


@pytest.mark.parametrize(
    "stage, micro, recompute",
    [(1, 2, Recompute.NONE), (2, 2, Recompute.FULL), (3, 1, Recompute.NONE)],
)
def test_written_gradients_are_autograds(stage: int, micro: int, recompute: Recompute) -> None:
    parallel = TensorParallel.from_topology(Topology.build(1), 0)
    reference = GPT(CONFIG, parallel, seed=0)
    model = GPT(CONFIG, parallel, seed=0, recompute=RecomputePolicy(recompute))
    batches = _micro_batches(micro)
    for ids in batches:
        (reference(ids[:, :-1], ids[:, 1:]) / micro).backward()
    autograd_made: set[str] = set()
    names = {id(p): name for name, p in model.named_parameters()}
    for p in model.parameters():  # before the engine's hook: sees what autograd gave
        p.register_post_accumulate_grad_hook(
            lambda q: autograd_made.add(names[id(q)]) if q.grad is not None else None
        )
    engine = _engine(model, parallel, stage, micro)
    for ids in batches:
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    stepped = _stepped_gradients(engine)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(stepped[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    # The Linear weights' gradients were written by the matmul: autograd made none.
    written = {n for n in names.values() if n.split(".", 2)[-1] in LINEAR_WEIGHTS}
    assert len(written) == 4 * CONFIG.n_layer
    assert autograd_made == set(names.values()) - written


class _Pair(nn.Module):
    """Two parallel Linears on one input: `share` ties the second's weight to the first's
    (registered twice); `reuse` also applies the first's weight outside its layer."""

    def __init__(self, parallel: TensorParallel, share: bool, reuse: bool) -> None:
        super().__init__()
        self.first = ColumnParallelLinear(8, 8, parallel, bias=False)
        self.second = RowParallelLinear(8, 8, parallel, bias=False)
        torch.manual_seed(0)
        nn.init.normal_(self.first.weight)
        nn.init.normal_(self.second.weight)
        if share:
            self.second.weight = self.first.weight
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.second(self.first(x))
        if self.reuse:
            y = y + F.linear(x, self.first.weight)
        return y.square().mean()


def test_a_weight_used_outside_its_layer_is_refused() -> None:
    parallel = TensorParallel.from_topology(Topology.build(1), 0)
    engine = _engine(_Pair(parallel, share=False, reuse=True), parallel, stage=2, micro=1)
    with pytest.raises(RuntimeError, match="first.weight received two gradients"):
        engine.backward(engine(torch.randn(4, 8)))


def test_a_weight_two_layers_share_is_summed_by_autograd() -> None:
    parallel = TensorParallel.from_topology(Topology.build(1), 0)
    x = torch.randn(4, 8)
    reference = _Pair(parallel, share=True, reuse=False)
    reference(x).backward()
    engine = _engine(_Pair(parallel, share=True, reuse=False), parallel, stage=2, micro=1)
    engine.backward(engine(x))
    stepped = _stepped_gradients(engine)
    assert list(stepped) == ["first.weight"]
    torch.testing.assert_close(stepped["first.weight"], reference.first.weight.grad)


def test_a_gradient_hook_on_a_weight_sees_and_changes_it() -> None:
    parallel = TensorParallel.from_topology(Topology.build(1), 0)
    x = torch.randn(4, 8)
    reference = _Pair(parallel, share=False, reuse=False)
    reference(x).backward()
    model = _Pair(parallel, share=False, reuse=False)
    engine = _engine(model, parallel, stage=2, micro=1)
    seen: list[torch.Tensor] = []
    model.first.weight.register_hook(lambda grad: seen.append(grad) or grad * 2)  # after
    engine.backward(engine(x))
    stepped = _stepped_gradients(engine)
    torch.testing.assert_close(seen[0], reference.first.weight.grad)
    torch.testing.assert_close(stepped["first.weight"], 2 * reference.first.weight.grad)
    torch.testing.assert_close(stepped["second.weight"], reference.second.weight.grad)
