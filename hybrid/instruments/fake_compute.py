"""The real code path with the arithmetic skipped: torch's FakeTensorMode.

    with fake_world(256, 255), fake_compute(), MemTracker(), FakeAnswers():
        engine = Engine(model, ...)   # the real model, Engine, hooks, buckets, collectives
        engine.backward(engine(inputs, targets)); engine.step(lr)

Every tensor made inside is a FakeTensor: it has a shape, a dtype, a device and a storage
of the right size, and every op computes its outputs' metadata without touching any
value. So the allocations (what MemTracker files by category), the kernels' FLOP counts
(torch's formulas, from shapes) and the collectives issued (their sizes) are those of the
real run, while one step of a 17B rank costs the Python of its ops, not a day of bf16
matrix products on a CPU without native kernels (launch.rehearse's default mode; torchtitan's
memory estimator runs on the same mode).

A value never exists, so the few places where Python reads one (`float(norm)`,
`loss.item()`, `bool(overflow)`) get a stand-in: 1.0 for a float (a finite gradient norm,
at which a clip threshold of 1 or more changes nothing), 0 for an integer, False for a
bool (no fp16 overflow). The step then takes the path of a healthy training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode


class FakeAnswers(TorchDispatchMode):
    """The two queries a fake tensor answers without a kernel, answered before the modes
    below see them; entered last, above the instruments. Neither allocates, so the
    instruments miss nothing, and each mode on the stack costs every op a Python call.

    - `tensor.device` (`prim.device`): an op of its own that would walk down the whole
      stack, the memory tracker's bookkeeping included, for an answer the tensor carries:
      over half of a fake step's ops (autograd asks it most).
    - a tensor read as a Python number (`_local_scalar_dense`): a stand-in value (see the
      module docstring), which FakeTensorMode cannot give.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if func is torch.ops.prim.device.default and isinstance(args[0], FakeTensor):
            return args[0].fake_device
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            if tensor.dtype == torch.bool:
                return False
            return 1.0 if tensor.dtype.is_floating_point else 0
        return func(*args, **(kwargs or {}))


@contextmanager
def fake_compute() -> Iterator[None]:
    """Every tensor made inside is fake (shapes, no values); modes entered inside it (the
    memory tracker, FLOP and collective counters) see the ops first, as they would real ones;
    enter FakeAnswers innermost, above them. `allow_non_fake_inputs`: a real tensor made
    before (the topology's, a constant) may meet a fake one."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield
