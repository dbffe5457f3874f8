"""The model as the tp=1, dp=1 model has it, one tensor at a time, and a safetensors file
written from that stream.

A full-state path (the end-of-run weights, an export) must never hold the whole model on
every rank, nor, under ZeRO-3, on any rank: at Turing-NLG scale (17B parameters) that is
68 GB in fp32. So the tensors are produced one by one, in bucket order: under stage 3 one
bucket is gathered at a time (its shards all-gathered over DP, then freed before the next),
and each TP-split parameter is gathered over TP alone. A consumer on one rank writes each
tensor out before asking for the next; the other ranks walk the same stream (they take
part in the collectives) and drop what they get. What is held at once is one bucket plus
one full parameter.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybrid.tensor_parallel import parameter_shards
from hybrid.tensor_parallel.shards import full_shape

if TYPE_CHECKING:
    from hybrid.engine import Engine

TensorLayout = list[tuple[str, tuple[int, ...], torch.dtype]]

# The safetensors format's dtype names (safetensors' README, "Format").
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def full_tensor_layout(engine: Engine) -> TensorLayout:
    """(name, tp=1 shape, dtype) of every parameter, in the order `full_tensors` yields."""
    specs = parameter_shards(engine.module)
    return [
        (name, full_shape(torch.empty(shape, device="meta"), specs.get(name)), engine.dtype)
        for bucket in engine.buckets
        for name, shape in zip(bucket.names, bucket.shapes, strict=True)
    ]


def write_safetensors(
    path: str | Path,
    layout: TensorLayout,
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a .safetensors file from a stream of tensors whose names, shapes and dtypes
    are known up front (`layout`, in stream order): the header goes first, then each
    tensor's bytes as it arrives, so only one tensor is in memory at a time (the
    safetensors package writes from a complete dict only). The file appears under its
    name only once complete (written beside it, then renamed)."""
    path = Path(path)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in layout:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        entry = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape)}
        header[name] = entry | {"data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    partial = path.with_name(path.name + ".partial")
    expected = iter(layout)
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name, tensor in tensors:
            want = next(expected, None)
            got = (name, tuple(tensor.shape), tensor.dtype)
            if want is None or got != (want[0], tuple(want[1]), want[2]):
                raise ValueError(f"{path}: tensor {got} arrived where the layout has {want}")
            _write_tensor(out, tensor)
            del tensor  # before the next tensor is gathered: one at a time
        missing = next(expected, None)
        if missing is not None:
            raise ValueError(f"{path}: the stream ended before tensor {missing[0]}")
    os.replace(partial, path)
    return path


WRITE_BLOCK_BYTES = 64 << 20  # a tensor goes to the file in blocks of whole rows this size


def _write_tensor(out: Any, tensor: torch.Tensor) -> None:
    """A tensor's bytes, row-major, in blocks of rows: what is copied at once (to host, to
    contiguous memory, or away from the tensor's own storage) is one block, not the tensor
    (a 4 GB embedding written whole would cost another 4 GB)."""
    rows = tensor.detach().reshape(-1) if tensor.dim() < 2 else tensor.detach()
    row_bytes = max(1, rows[0].numel() * rows.element_size()) if len(rows) else 1
    for block in rows.split(max(1, WRITE_BLOCK_BYTES // row_bytes)):
        data = block.contiguous().reshape(-1).view(torch.uint8).cpu()
        if data.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            # Handing a tensor's own storage to numpy marks it non-resizable for good,
            # and stage 3 frees its buckets by resizing them: write a copy.
            data = data.clone()
        out.write(memoryview(data.numpy()))
        del data
