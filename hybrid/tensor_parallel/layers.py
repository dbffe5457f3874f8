"""Megatron-LM's tensor-parallel layers (Shoeybi et al. 2019, section 3).

Activations are (sequence, batch, features). A column-parallel Linear holds a slice of the
output features and sees the whole input; a row-parallel Linear holds a slice of the input
features, and the partial outputs are summed across TP ranks. Column followed by row needs
one all-reduce forward (g) and one backward (f) for the pair.

Under sequence parallelism (Korthikanti et al. 2022) the input of a column-parallel layer
arrives split along the sequence and is all-gathered; the output of a row-parallel layer
is reduce-scattered back into sequence chunks. The column layer keeps only its input's
chunk for backward and gathers it again there, so the stored activation is 1/tp of the
full one, as the paper's memory formula assumes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.distributed.comm import Group
from hybrid.tensor_parallel.context import TensorParallel
from hybrid.tensor_parallel.linear import linear
from hybrid.tensor_parallel.mappings import (
    copy_to_region,
    reduce_from_region,
    reduce_scatter_to_sequence,
)
from hybrid.tensor_parallel.shards import ShardSpec
from hybrid.tensor_parallel.weight_grads import Sink, set_weight_gradient_sink, weight_gradient


class _GatherSequenceLinear(torch.autograd.Function):
    """linear(all_gather_seq(x), W, b), saving only x's sequence chunk for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group
    ) -> torch.Tensor:
        ctx.group, ctx.has_bias, ctx.parameter = group, bias is not None, weight
        ctx.save_for_backward(x, weight)
        return F.linear(group.all_gather(x, dim=0), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        total = ctx.group.all_gather(x, dim=0).to(grad.dtype)  # re-gathered, not stored
        grad_input = ctx.group.reduce_scatter(grad.matmul(weight.to(grad.dtype)), dim=0)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = weight_gradient(ctx.parameter, flat_grad, total.reshape(-1, total.shape[-1]))
        grad_bias = flat_grad.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_input.to(x.dtype), grad_weight, grad_bias, None


def parallel_linear_input(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel
) -> torch.Tensor:
    """Apply a column-split weight to an input that is replicated (f, then the matmul) or,
    under sequence parallelism, split along the sequence (gather, then the matmul)."""
    if tp.sequence_parallel and tp.size > 1:
        return _GatherSequenceLinear.apply(x, weight, bias, tp.group)
    return linear(copy_to_region(x, tp.group), weight, bias)


def reduce_parallel_output(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum partial outputs across TP: all-reduce (g), or reduce-scatter under SP."""
    if tp.sequence_parallel:
        return reduce_scatter_to_sequence(y, tp.group)
    return reduce_from_region(y, tp.group)


def _split_size(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what}: {size} is not divisible by tensor-parallel size {parts}")
    return size // parts


class ColumnParallelLinear(nn.Module):
    """y_i = x W_i^T + b_i with W split by output features; y stays split across TP."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = True
    ) -> None:
        super().__init__()
        self.tp, self.out_features = tp, out_features
        local = _split_size(out_features, tp.size, "ColumnParallelLinear out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_linear_input(x, self.weight, self.bias, self.tp)

    def tp_shards(self) -> dict[str, ShardSpec]:
        spec = ShardSpec(0, self.out_features, self.tp.size)
        return {"weight": spec, "bias": spec} if self.bias is not None else {"weight": spec}


class RowParallelLinear(nn.Module):
    """y = sum_i x_i W_i^T + b with W split by input features; x arrives split across TP.
    The bias is replicated and added once, after the reduction."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = True
    ) -> None:
        super().__init__()
        self.tp, self.in_features = tp, in_features
        local = _split_size(in_features, tp.size, "RowParallelLinear in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """`activation` ("gelu", "gelu_tanh") is applied to x first, inside the layer's
        backward (hybrid.tensor_parallel.linear): one b*s*in/tp buffer fewer at its peak."""
        if self.tp.size == 1:  # no reduction: the bias goes into the matmul (one addmm)
            return linear(x, self.weight, self.bias, activation)
        y = reduce_parallel_output(linear(x, self.weight, None, activation), self.tp)
        return y + self.bias if self.bias is not None else y

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(1, self.in_features, self.tp.size)}


class _VocabTable(nn.Module):
    """A (vocabulary, dim) table split by vocabulary rows across TP ranks, padded to a
    multiple of tp (padding rows are zero)."""

    def __init__(self, num_embeddings: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.num_embeddings = tp, num_embeddings
        self.local_size = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.local_size
        self.weight = nn.Parameter(torch.empty(self.local_size, dim))

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(0, self.num_embeddings, self.tp.size)}


class VocabParallelEmbedding(_VocabTable):
    """Embedding with the vocabulary split across TP ranks.

    Padding rows are never looked up. Each rank looks up the ids in its range and writes
    zeros for the others; the sum over ranks (all-reduce, or reduce-scatter along the
    sequence under SP) is the embedding.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_parallel_output(out, self.tp)


class VocabParallelOutput(_VocabTable):
    """An output layer (untied from the embedding) with the vocabulary split across TP:
    each rank computes the logits of its vocabulary slice, (..., V/tp), for the
    vocabulary-parallel loss; padding columns are masked there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_linear_input(x, self.weight, None, self.tp)


def attach_weight_gradient_sinks(model: nn.Module, sink: Sink) -> None:
    """Set `sink` on the weight of every ColumnParallelLinear and RowParallelLinear of
    `model` whose weight the model registers exactly once."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            weight = module.weight
            if weight.requires_grad and uses[id(weight)] == 1:
                set_weight_gradient_sink(weight, sink)
