"""Which parameters are split across TP ranks, and how: initialisation from one seed,
gathering the full tensors back.

A tensor-parallel layer reports its split parameters through `tp_shards()` (name -> spec);
nothing is attached to the parameters themselves. Every other parameter is replicated.

Initialisation (Megatron-LM's rule, DESIGN.md section 4): every parameter's value is
defined as a whole tp=1 tensor from (seed, parameter name), and each rank keeps its slice,
so a model at any tp starts from exactly the weights of the tp=1 model. The random values
are counter-based (hybrid.tensor_parallel.seeded): element i of the tp=1 tensor is a pure
function of (seed, name, i), so a rank draws only the elements it keeps (its TP slice, or
under ZeRO-3 only its DP shard of it), never the full tensor. The model's rule says, per
parameter, value = fill + std * N(0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from hybrid.distributed.comm import Group
from hybrid.tensor_parallel.seeded import seeded_normal

CHUNK = 1 << 22  # local elements per pass: bounds the index temporaries (8 bytes each)


class Init(NamedTuple):
    """A parameter's initial distribution: value = fill + std * N(0, 1) elementwise;
    std == 0 is the constant `fill` (nothing drawn)."""

    fill: float
    std: float = 0.0


InitRule = Callable[[str, tuple[int, ...]], Init]  # (name, tp=1 shape) -> Init


@dataclass(frozen=True)
class ShardSpec:
    """A parameter split along `dim` into `parts` equal slices; the full tensor has
    `logical_size` meaningful entries along `dim`, the rest (up to parts * local) padding."""

    dim: int
    logical_size: int
    parts: int


def parameter_shards(model: nn.Module) -> dict[str, ShardSpec]:
    """Full parameter name -> spec, for every TP-split parameter of `model`."""
    specs: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        shards = getattr(module, "tp_shards", None)
        if callable(shards):
            for name, spec in shards().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def full_shape(param: torch.Tensor, spec: ShardSpec | None) -> tuple[int, ...]:
    """The shape of the tp=1 parameter (without padding)."""
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.logical_size
    return tuple(shape)


def local_shape(full: tuple[int, ...], spec: ShardSpec | None) -> tuple[int, ...]:
    """The shape of one rank's slice of a tp=1 tensor (padding included)."""
    if spec is None:
        return full
    shape = list(full)
    shape[spec.dim] = -(-spec.logical_size // spec.parts)
    return tuple(shape)


def full_indices(
    full: tuple[int, ...], spec: ShardSpec | None, rank: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where this TP rank's local flat elements [start, end) sit in the flattened tp=1
    tensor, and which of them are real (None: all; the others are padding past
    `logical_size` along the split dim, whose index is meaningless)."""
    local = torch.arange(start, end, dtype=torch.int64)
    if spec is None:
        return local, None
    # Row-major (outer, j, inner) over the local shape; only j, along the split dim, moves.
    width = local_shape(full, spec)[spec.dim]
    inner = math.prod(full[spec.dim + 1 :])
    outer, rest = local // (width * inner), local % (width * inner)
    j, k = rest // inner + rank * width, rest % inner
    real = j < spec.logical_size
    return (outer * spec.logical_size + j) * inner + k, real


def seeded_elements(
    name: str,
    full: tuple[int, ...],
    spec: ShardSpec | None,
    seed: int,
    rule: InitRule,
    rank: int,
    start: int,
    end: int,
) -> torch.Tensor:
    """Local flat elements [start, end) (float32, CPU) of this TP rank's slice of parameter
    `name`'s seeded value: its tp=1 tensor of shape `full`, sliced and zero-padded as
    `local_slice` does. Only those elements' random values are drawn, padding excluded."""
    fill, std = rule(name, full)
    out = torch.empty(end - start, dtype=torch.float32)
    for lo in range(start, end, CHUNK):
        hi = min(end, lo + CHUNK)
        index, real = full_indices(full, spec, rank, lo, hi)
        piece = out[lo - start : hi - start]
        if std == 0:
            piece.fill_(fill)
        elif real is None:
            piece.copy_(seeded_normal(seed, name, index) * std + fill)
        else:
            piece[real] = seeded_normal(seed, name, index[real]) * std + fill
        if real is not None:
            piece.masked_fill_(~real, 0.0)
    return out


@torch.no_grad()
def init_from_seed(model: nn.Module, seed: int, rule: InitRule, rank: int) -> None:
    """Fill every parameter with this TP rank's slice of its seeded tp=1 value."""
    specs = parameter_shards(model)
    for name, param in model.named_parameters():
        param.copy_(seeded_slice(name, param, specs.get(name), seed, rule, rank))


def seeded_slice(
    name: str, param: torch.Tensor, spec: ShardSpec | None, seed: int, rule: InitRule, rank: int
) -> torch.Tensor:
    """This TP rank's slice of parameter `name`'s seeded tp=1 value, shaped like `param`
    (which may be on the meta device: only its shape is read); CPU, float32."""
    full = full_shape(param, spec)
    return seeded_elements(name, full, spec, seed, rule, rank, 0, param.numel()).view(param.shape)


def local_slice(full: torch.Tensor, spec: ShardSpec | None, rank: int) -> torch.Tensor:
    """Rank's slice of a full tensor, zero-padded along the split dim where needed."""
    if spec is None:
        return full
    local = -(-spec.logical_size // spec.parts)
    padding = local * spec.parts - full.shape[spec.dim]
    if padding:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = padding
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    return full.narrow(spec.dim, rank * local, local)


def gather_full(tensor: torch.Tensor, spec: ShardSpec | None, group: Group) -> torch.Tensor:
    """The tp=1 tensor from every rank's slice (padding removed)."""
    if spec is None:
        return tensor
    full = group.all_gather(tensor.contiguous(), dim=spec.dim)
    return full.narrow(spec.dim, 0, spec.logical_size)


def named_full_tensors(
    model: nn.Module, group: Group, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full parameter or gradient) for every parameter, gathered across TP."""
    specs = parameter_shards(model)
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            continue
        yield name, gather_full(tensor, specs.get(name), group)
