"""Our parallel Linears' weight gradients written by their backward straight into the
engine's buckets (hybrid.tensor_parallel.weight_grads): autograd's gradients to fp32
rounding, over micro-batches and under recomputation, at tp 1 and (in a 2-rank job) tp 2
with sequence parallelism; no autograd gradient made for those
weights; a gradient hook on a weight still sees and changes its gradient; a weight also
used outside its layer refused with an error, not summed wrong; a weight two layers share
left to autograd, which sums its uses.

Tolerance: 1e-6 absolute, 1e-5 relative (fp32). The same products are summed in another
order (a micro-batch's product added into the buffer by the matmul, against autograd's
two gradients added after), which moves the last bits only; a lost micro-batch, a
transposed or misplaced gradient moves them by the gradient's own size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from weight_grads_cases import (
    CONFIG,
    LINEAR_WEIGHTS,
    autograd_made_recorder,
    engine_of,
    micro_batches,
    sequence_parallel_sinks,
    stepped_gradients,
)

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine
from hybrid.instruments.local_processes import run_processes
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from models.gpt import GPT


def _engine(model: nn.Module, parallel: TensorParallel, stage: int, micro: int) -> Engine:
    return engine_of(model, Topology.build(1), parallel, stage, micro)


def _assert_written(names: set[str], autograd_made: set[str]) -> None:
    """The Linear weights' gradients were written by the matmul: autograd made none."""
    written = {n for n in names if n.split(".", 2)[-1] in LINEAR_WEIGHTS}
    assert len(written) == 4 * CONFIG.n_layer
    assert autograd_made == names - written


@pytest.mark.parametrize(
    "stage, micro, recompute",
    [(1, 2, Recompute.NONE), (2, 2, Recompute.FULL), (3, 1, Recompute.NONE)],
)
def test_written_gradients_are_autograds(stage: int, micro: int, recompute: Recompute) -> None:
    parallel = TensorParallel.from_topology(Topology.build(1), 0)
    reference = GPT(CONFIG, parallel, seed=0)
    model = GPT(CONFIG, parallel, seed=0, recompute=RecomputePolicy(recompute))
    batches = micro_batches(micro)
    for ids in batches:
        (reference(ids[:, :-1], ids[:, 1:]) / micro).backward()
    autograd_made = autograd_made_recorder(model)
    engine = _engine(model, parallel, stage, micro)
    for ids in batches:
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    stepped = stepped_gradients(engine)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(stepped[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    _assert_written({name for name, _ in model.named_parameters()}, autograd_made)


def test_written_gradients_under_sequence_parallel_recomputation() -> None:
    """tp 2 with SP: the column Linears' backward re-gathers its input
    (_GatherSequenceLinear) and, under recomputation, must still find the parameter's sink
    (a saved copy has none: its gradient would go through autograd, right but not fused)."""
    for rank, run in enumerate(run_processes(sequence_parallel_sinks, 2, timeout_s=120)):
        for name, grad in run["reference"].items():
            torch.testing.assert_close(
                run["stepped"][name], grad, atol=1e-6, rtol=1e-5, msg=f"rank {rank}: {name}"
            )
        _assert_written(set(run["reference"]), set(run["autograd_made"]))


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
    stepped = stepped_gradients(engine)
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
    stepped = stepped_gradients(engine)
    torch.testing.assert_close(seen[0], reference.first.weight.grad)
    torch.testing.assert_close(stepped["first.weight"], 2 * reference.first.weight.grad)
    torch.testing.assert_close(stepped["second.weight"], reference.second.weight.grad)
