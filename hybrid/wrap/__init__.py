"""ZeRO for any PyTorch model: one call turns a module into the Engine that trains it.

    engine = wrap(model, Topology.build(), EngineConfig(zero_stage=3))
    for x, y in batches:
        engine.backward(loss_fn(engine(x), y))
        engine.step(lr)

The model is trained as it is, at tp=1 (tensor parallelism needs a model built from
hybrid.tensor_parallel layers, as models/gpt is). Its units (hybrid.wrap.units: the
repeated blocks) are the Engine's buckets: stage 3 gathers one unit at a time. A model
built on the meta device is initialised shard by shard by its own init code
(hybrid.wrap.meta_init), or from `values` (e.g. a checkpoint read lazily), so at stage 3
no rank ever holds the whole model. Tied parameters (an embedding shared with the output
layer) are one parameter object, laid out once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from hybrid.wrap.meta_init import MetaInit
from hybrid.wrap.units import UnitSpec, find_units, recompute_units

__all__ = ["MetaInit", "StateDictValues", "find_units", "wrap"]


def wrap(
    model: nn.Module,
    topology: Topology,
    config: EngineConfig | None = None,
    units: UnitSpec = None,
    *,
    recompute: bool = False,
    device: torch.device | None = None,
    values: Any = None,
) -> Engine:
    """The Engine training `model` with ZeRO `config.zero_stage` over the topology's DP
    group. `units`: the repeated blocks (default: the children of the largest ModuleList;
    or modules, or class names); `recompute`: full recomputation of every unit; `device`:
    where the states live (default: the model's, else the current CUDA device when the job
    runs on CUDA, else the CPU); `values`: a meta model's initial values, a state dict or
    an object with `initial_values(name, start, end)` (e.g. a checkpoint read lazily:
    models.hf_native.weights); default: its own init, drawn shard by shard."""
    if topology.tp != 1:
        raise ValueError(
            f"hybrid.wrap trains a model as it is, with data parallelism only, but the "
            f"topology has tp={topology.tp}; build it with Topology.build(tp=1), or build the "
            "model from hybrid.tensor_parallel layers (as models/gpt does) for tp > 1"
        )
    found = find_units(model, units)
    device = device or default_device(model, topology)
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if on_meta:  # the model's own init fills the buffers (and the parameters, unless given)
        init = MetaInit(model, device, require_all=values is None)
        values = init if values is None else values
    if isinstance(values, Mapping):
        values = StateDictValues(values)
        values.copy_buffers(model)
    if recompute:
        recompute_units(found)
    tp = TensorParallel.single(0, device)
    return Engine(model, topology, tp, config or EngineConfig(), found, device, values)


class StateDictValues:
    """A state dict (full tensors by parameter name) as the values of a meta model: each
    rank copies out its shard's elements (the dict itself is the caller's memory)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    @torch.no_grad()
    def copy_buffers(self, model: nn.Module) -> None:
        """The buffers the state dict holds (persistent ones: e.g. a norm's statistics)."""
        for name, buffer in model.named_buffers():
            if name in self.state and buffer.device.type != "meta":
                buffer.copy_(self.state[name])

    def initial_values(self, name: str, start: int, end: int) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"the state dict has no {name}, a parameter of the model")
        return self.state[name].detach().reshape(-1)[start:end]

    def initial_value(self, name: str) -> torch.Tensor:
        return self.initial_values(name, 0, self.state[name].numel()).view(self.state[name].shape)


def default_device(model: nn.Module, topology: Topology) -> torch.device:
    real = [p.device for p in model.parameters() if p.device.type != "meta"]
    if real:
        return real[0]
    mesh = topology.mesh
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
