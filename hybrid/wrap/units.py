"""The units of a model the Engine buckets, gathers (ZeRO-3) and recomputes one at a time:
its repeated blocks. By default the children of its largest `nn.ModuleList` (by
parameters): a transformer's layers, whatever the architecture calls them; or every
outermost module of the classes named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

UnitSpec = Sequence[nn.Module | type | str] | None


def find_units(model: nn.Module, units: UnitSpec = None) -> list[nn.Module]:
    """The model's units: `units` itself when it lists modules; the outermost modules of
    the classes it names (types, or class names such as "Qwen2DecoderLayer"); by default
    the children of the largest ModuleList. ValueError when there are none."""
    if units is not None and all(isinstance(u, nn.Module) for u in units):
        return list(units)
    if units is not None:
        names = {u if isinstance(u, str) else u.__name__ for u in units}
        found: list[nn.Module] = []
        inside: set[int] = set()
        for module in model.modules():  # parents before their children
            if id(module) not in inside and type(module).__name__ in names:
                found.append(module)
                inside.update(id(m) for m in module.modules())
        if not found:
            raise ValueError(
                f"no module of class {sorted(names)} in {type(model).__name__}; name the "
                "class of its repeated blocks (e.g. units=['LlamaDecoderLayer'])"
            )
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList to take its units (repeated "
            "blocks) from; give them: units=[...] (modules, or their class names)"
        )
    largest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(largest)


def recompute_units(units: list[nn.Module]) -> None:
    """Full recomputation of every unit (Korthikanti et al. 2022, section 5): only a unit's
    input is kept for backward, its forward runs again there. The unit's `forward` is
    checkpointed, not its call: the module's hooks (the ZeRO-3 gather) stay outside, so
    they run once in forward and the recomputation finds the parameters gathered by the
    gradient hook that starts the unit's backward."""
    for unit in units:
        forward = unit.forward

        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        unit.forward = checkpointed
