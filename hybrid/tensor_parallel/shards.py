"""Which parameters are split across TP ranks, and how: initialisation from one seed,
gathering the full tensors back.

A tensor-parallel layer reports its split parameters through `tp_shards()` (name -> spec);
nothing is attached to the parameters themselves. Every other parameter is replicated.

Initialisation (Megatron-LM's rule, DESIGN.md section 4): each rank draws the *full*
tensor of every parameter from a generator seeded by (seed, parameter name), then keeps
its slice. The draw does not depend on tp, on the order modules were built or on other
parameters, so a model at any tp starts from exactly the weights of the tp=1 model, and
only one full parameter exists at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Group

InitRule = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


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


def parameter_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@torch.no_grad()
def init_from_seed(model: nn.Module, seed: int, rule: InitRule, rank: int) -> None:
    """Fill every parameter with this TP rank's slice of its seeded full tensor."""
    specs = parameter_shards(model)
    for name, param in model.named_parameters():
        param.copy_(seeded_slice(name, param, specs.get(name), seed, rule, rank))


def seeded_slice(
    name: str, param: torch.Tensor, spec: ShardSpec | None, seed: int, rule: InitRule, rank: int
) -> torch.Tensor:
    """This TP rank's slice of parameter `name`'s seeded full tensor (`param` may be on
    the meta device: only its shape is read)."""
    full = rule(name, full_shape(param, spec), parameter_generator(seed, name))
    return local_slice(full, spec, rank)


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
