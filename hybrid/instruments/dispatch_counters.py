"""Counters at torch's dispatcher, instruments outside the code they measure: the bytes
each collective moves (`CollectiveTrace`) and the FLOPs executed (`FlopCount`).

`CollectiveTrace` stands beside the library's own `CollectiveCounter` (hybrid.distributed.comm),
which only counts what our code says it sends. Every process-group collective reaches the
dispatcher as a `c10d` op carrying its tensors and its process group; this mode records, per
(kind, group), the calls, the full-tensor bytes (hybrid.distributed.comm's convention: an
all-reduce's tensor, an all-gather's output, a reduce-scatter's input) and the bytes a ring
implementation sends from this rank (the ZeRO paper's section 7 convention): 2 S (n-1)/n for an
all-reduce of S bytes over n ranks, S (n-1)/n for an all-gather or reduce-scatter of S, S
(n-1)/n for a broadcast (a pipelined ring's share per rank). A point-to-point send
(hybrid.distributed.pairwise's exchanges on gloo) is counted as kind "send", its bytes sent as
they are."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> (kind, index of the tensor whose size counts)
_OPS = {
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),  # the output
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),  # the input
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
}
_RING = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value)  # a list of tensors


def _process_group(args: tuple[Any, ...]) -> dist.ProcessGroup:
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg)
    raise ValueError("a c10d op without a process group")


class CollectiveTrace(TorchDispatchMode):
    """Counts collectives issued while active. `names` maps a process group's
    `group_name` to the name reported (e.g. {"5": "tp", "2": "dp"}); others by size."""

    def __init__(self, names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.names = names or {}
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.sent: dict[tuple[str, str], float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "c10d":
            op = func.__name__.split(".")[0]
            if op in _OPS:
                kind, index = _OPS[op]
                group = _process_group(args)
                size = group.size()
                name = self.names.get(group.group_name, f"group of {size}")
                nbytes = _nbytes(args[index])
                self.calls[kind, name] += 1
                self.bytes[kind, name] += nbytes
                if kind == "send":
                    self.sent[kind, name] += nbytes
                else:
                    self.sent[kind, name] += _RING[kind] * nbytes * (size - 1) / size
        return func(*args, **(kwargs or {}))

    def sent_by_group(self) -> dict[str, float]:
        """Ring bytes sent from this rank, per group name."""
        out: dict[str, float] = defaultdict(float)
        for (_, name), value in self.sent.items():
            out[name] += value
        return dict(out)


# torch's FLOP registry has the CUDA attention kernels but not the CPU one; same formulas.
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class FlopCount(TorchDispatchMode):
    """FLOPs of the operations run while active, by torch's own formulas
    (`torch.utils.flop_counter.flop_registry`: matrix products and attention, 2 per
    multiply-add). Unlike `FlopCounterMode` it tracks no modules: FlopCounterMode's module
    tracking keeps every layer's recomputed activations alive until backward ends
    (measured: ~16 MB a layer of a 17B rank), which would falsify a memory measurement
    taken at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_counter.flop_registry:
            self.flops += flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet is _CPU_ATTENTION:
            q, k, v = args[:3]
            self.flops += flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
        elif packet is _CPU_ATTENTION_BACKWARD:
            grad, q, k, v = args[:4]
            self.flops += flop_counter.sdpa_backward_flop_count(
                grad.shape, q.shape, k.shape, v.shape
            )
        return out
