"""A Hugging Face checkpoint folder read lazily: each rank reads only what it keeps.

    weights = open_hf_weights("path/to/checkpoint", config)  # headers only, all checked
    model = GPT(config, tp, device="meta", init_weights=weights)  # the Engine reads

`open_hf_weights` reads the safetensors headers (model.safetensors, the shards named by
model.safetensors.index.json, or model-0000k-of-0000n.safetensors shards without an
index) and checks every tensor's name and shape against the config before anything
starts. `HFWeights.read` then hands out any flat range of one TP rank's slice of one of
our tensors, reading from the memory-mapped files only the rows that range covers (and
only this rank's columns when the split is along dim 1), not the whole tensor.

The layouts (GPT-2's transposed Conv1D and [q | k | v], Llama's separate q, k, v and
gate, up) are hf_layouts.py's import functions, run once on row ids instead of tensors:
that tells, for every row of each of our tensors, which stored tensor and row it is. A
read sorts the rows it needs into contiguous runs and reads each run as one slice.

A safetensors file is opened per read and unmapped after, so a rank's resident memory
holds what it keeps plus the piece being read. pytorch_model.bin is hf_bin.py's (mapped
for the whole import, refused above a size, converted by `bin_to_safetensors`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from hybrid.tensor_parallel.shards import ShardSpec, local_shape
from models.gpt.config import GPTConfig
from models.gpt.hf.bin import bin_to_safetensors, check_bin_size, load_bin
from models.gpt.hf.families import family_of
from models.gpt.hf.layouts import PREFIX, Reader, import_all, is_buffer, to_hf
from models.gpt.hf.weight_files import weight_files
from models.gpt.model import GPT

Tensor = torch.Tensor
__all__ = ["HFWeights", "Stored", "bin_to_safetensors", "open_hf_weights", "weight_files"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
}  # fmt: skip
_ROW_BITS = 32  # a row id is (source index << 32) + row in that source
# A read maps at most this much of a file at a time (then unmaps it): mapped pages count in
# a rank's resident memory, so what a read adds is the tensor it returns plus this.
_MAPPED_BYTES = 16 << 20


@dataclass(frozen=True)
class Stored:
    """One tensor as a checkpoint file stores it (Hugging Face name and shape)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Plan:
    """Where one of our tensors' rows are: `rows[r]` is (source << 32) + stored row
    (8 bytes a row: 64 MB for all of Llama 70B's tensors, against 17 GB of weights a rank
    keeps at tp=8)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Tensor


class _RowIds(Reader):
    """A Reader whose tensors are row ids: run through hf_layouts' import, each of our
    tensors comes out as the ids of its rows (the layouts move rows along dim 0 only)."""

    def __init__(self, stored: Mapping[str, Stored], prefix: str) -> None:
        super().__init__(stored, prefix)  # type: ignore[arg-type]
        self.sources: list[tuple[Stored, bool]] = []  # (tensor, read transposed)

    def take(self, name: str) -> Tensor:
        return self._ids(name, transposed=False)

    def take_transposed(self, name: str) -> Tensor:
        return self._ids(name, transposed=True)

    def _ids(self, name: str, transposed: bool) -> Tensor:
        stored: Stored = super().take(name)  # type: ignore[assignment]
        self.sources.append((stored, transposed))
        rows = stored.shape[1 if transposed else 0]
        return ((len(self.sources) - 1) << _ROW_BITS) + torch.arange(rows)


class HFWeights:
    """A WeightSource (models.gpt.weight_source) over a checkpoint folder's files."""

    def __init__(
        self, where: Path, stored: dict[str, Stored], bins: dict[Path, dict], config: GPTConfig
    ) -> None:
        self.where, self._bins = where, bins
        family = family_of(config)
        ours = _our_shapes(config)
        _check(where, stored, _expected_hf_shapes(family, config, ours), family, config)
        reader = _RowIds(stored, PREFIX[family])
        self._sources = reader.sources
        self._plans: dict[str, _Plan] = {}
        for name, rows in import_all(family, reader, config).items():
            used = {self._sources[int(i)][0].dtype for i in torch.unique(rows >> _ROW_BITS)}
            dtype = functools.reduce(torch.promote_types, used)
            assert len(rows) == ours[name][0], name  # the layouts keep every row
            self._plans[name] = _Plan(ours[name], dtype, rows)

    def names(self) -> list[str]:
        return list(self._plans)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._plans[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._plans[name].dtype

    def read(self, name: str, spec: ShardSpec | None, tp_rank: int, start: int, end: int) -> Tensor:
        """Local flat elements [start, end) of `name`'s slice for `tp_rank`; only the local
        rows covering them are read (this rank's columns of them under a dim-1 split)."""
        plan = self._plans[name]
        if len(plan.shape) > 2:
            raise ValueError(f"{name}: only 1-D and 2-D tensors are read lazily")
        if end <= start:
            return torch.empty(0, dtype=plan.dtype)
        local = local_shape(plan.shape, spec)
        cols = local[1] if len(local) == 2 else 1
        first, last = start // cols, -(-end // cols)  # the local rows covering the range
        # Empty, not zeros: only the padding is zeroed, the rest is written once.
        block = torch.empty((last - first, *local[1:]), dtype=plan.dtype)
        rows, c0, c1 = torch.arange(first, last), 0, cols
        if spec is not None and spec.dim == 0:
            rows = rows + tp_rank * local[0]
        elif spec is not None:
            c0 = tp_rank * local[1]
            c1 = max(c0, min(c0 + local[1], spec.logical_size))
        real = rows < plan.shape[0]  # rows past the end are padding: zeros
        if c1 <= c0 or not bool(real.any()):
            return block.zero_().reshape(-1)[start - first * cols : end - first * cols]
        block[~real] = 0
        if block.dim() == 2:
            block[:, c1 - c0 :] = 0  # columns past logical_size (a dim-1 split's padding)
        self._fill(block, plan.rows[rows[real]], torch.arange(last - first)[real], c0, c1)
        offset = first * cols
        return block.reshape(-1)[start - offset : end - offset]

    def _fill(self, block: Tensor, ids: Tensor, at: Tensor, c0: int, c1: int) -> None:
        """block[at[i]] = stored row ids[i] (columns [c0, c1)), one slice per run of
        consecutive rows of one stored tensor, in pieces of at most _MAPPED_BYTES."""
        order = torch.argsort(ids)
        ids, at = ids[order], at[order]
        breaks = (torch.diff(ids) != 1).nonzero().flatten() + 1
        bounds = [0, *breaks.tolist(), len(ids)]
        for a, b in itertools.pairwise(bounds):
            first = int(ids[a])
            stored, transposed = self._sources[first >> _ROW_BITS]
            lo = first & ((1 << _ROW_BITS) - 1)
            row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
            step = max(1, _MAPPED_BYTES // row_bytes)  # stored rows a piece maps
            if not transposed:
                target = block[:, : c1 - c0] if block.dim() == 2 else block
                for r in range(0, b - a, step):
                    n = min(step, b - a - r)
                    with self._sliced(stored) as sliced:
                        if len(stored.shape) == 1:
                            piece = sliced[lo + r : lo + r + n]
                        else:
                            piece = sliced[lo + r : lo + r + n, c0:c1]
                        _place(target, at[a + r : a + r + n], piece)
                continue
            for c in range(c0, c1, step):  # our columns are the stored tensor's rows
                n = min(step, c1 - c)
                with self._sliced(stored) as sliced:
                    piece = sliced[c : c + n, lo : lo + b - a].t()
                    _place(block[:, c - c0 : c - c0 + n], at[a:b], piece)

    @contextmanager
    def _sliced(self, stored: Stored) -> Iterator[Any]:
        """The stored tensor, sliceable, pages mapped only while it is used (a bin file's
        state stays mapped)."""
        if stored.file in self._bins:
            yield self._bins[stored.file][stored.key]
            return
        with safe_open(str(stored.file), framework="pt") as f:
            yield f.get_slice(stored.key)


def _place(target: Tensor, rows: Tensor, piece: Tensor) -> None:
    """target[rows] = piece, a plain copy when the rows are consecutive."""
    if bool((torch.diff(rows) == 1).all()):
        target[int(rows[0]) : int(rows[0]) + len(rows)] = piece
    else:
        target[rows] = piece.to(target.dtype)


def open_hf_weights(folder: str | Path, config: GPTConfig) -> HFWeights:
    """The lazy WeightSource of a Hugging Face checkpoint folder for our `config` (from its
    config.json: models.gpt.hf.folder.read_hf_config). Reads headers only; ValueError or
    FileNotFoundError, one line naming the file and the key, for a missing shard or
    tensor, a wrong shape, a tensor with no place in the model, an unreadable file."""
    where, files, weight_map = weight_files(Path(folder))
    stored: dict[str, Stored] = {}
    bins: dict[Path, dict] = {}
    if files[0].suffix == ".bin":
        check_bin_size(Path(folder), files)
        for file in files:
            bins[file] = load_bin(file)
            stored |= {k: Stored(file, k, tuple(t.shape), t.dtype) for k, t in bins[file].items()}
            for key, tensor in bins[file].items():
                if not tensor.is_floating_point():
                    raise ValueError(f"{file}: tensor {key!r} is {tensor.dtype}, not a weight")
    else:
        for file in files:
            stored |= _headers(file)
    for key, name in (weight_map or {}).items():
        if key not in stored or stored[key].file.name != name:
            raise ValueError(f"{where}: lists {key!r} in {name}, which does not hold it")
    return HFWeights(where, stored, bins, config)


def _headers(file: Path) -> dict[str, Stored]:
    try:
        with safe_open(str(file), framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118
            dtypes = {key: s.get_dtype() for key, s in slices.items()}
            shapes = {key: tuple(s.get_shape()) for key, s in slices.items()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from error
    stored = {}
    for key, dtype in dtypes.items():
        if dtype not in _DTYPES:
            raise ValueError(f"{file}: tensor {key!r} is {dtype}, not a floating-point weight")
        stored[key] = Stored(file, key, shapes[key], _DTYPES[dtype])
    return stored


# -- checks ---------------------------------------------------------------------------


def _our_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    model = GPT(config, device="meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _expected_hf_shapes(
    family: str, config: GPTConfig, ours: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Hugging Face name (no prefix) -> shape, from the export layout run on meta tensors."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in ours.items()}
    exported = to_hf(family, meta, config)
    hf = {k.removeprefix(PREFIX[family]): tuple(v.shape) for k, v in exported.items()}
    if not config.tie_embeddings:
        hf["lm_head.weight"] = ours["lm_head.weight"]
    return hf


def _check(
    where: Path,
    stored: dict[str, Stored],
    expected: dict[str, tuple[int, ...]],
    family: str,
    config: GPTConfig,
) -> None:
    """One line for the first missing tensor, wrong shape, or tensor left over."""
    prefix = PREFIX[family]
    have = {key.removeprefix(prefix): s for key, s in stored.items()}
    config_file = (where if where.is_dir() else where.parent) / "config.json"
    for name, shape in expected.items():
        if name not in have:
            key = name if name == "lm_head.weight" else prefix + name
            raise ValueError(f"{where}: no tensor {key!r}, which {config_file} needs")
        if have[name].shape != shape:
            s = have[name]
            raise ValueError(
                f"{s.file}: tensor {s.key!r} has shape {s.shape}; {config_file} implies {shape}"
            )
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    left = sorted(k for k in have.keys() - expected.keys() - tied if not is_buffer(k))
    if left:
        s = have[left[0]]
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise ValueError(
            f"{s.file}: tensor {s.key!r}{more} has no place in the {family} model of {config_file}"
        )
