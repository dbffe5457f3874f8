"""Whole tensors out of a checkpoint, one process, no Engine and no process group.

    reader = CheckpointTensors(path)
    reader.layout()  # {"model.wte.weight": (shape, dtype), ...}: from the index alone
    for key, tensor in reader.stream(["model.wte.weight", ...]):  # one at a time
        ...

A checkpoint stores each tensor as chunks, written by whichever ranks owned them
(hybrid.checkpoint.engine_state); DCP's loader copies the chunks that overlap a requested tensor
into it, so a plain tensor of the full shape gets the whole of it whatever layout wrote it. Only
the requested keys are read: an export reads `model.*` and never a byte of the Adam moments. The
index is read once, through SafeReader (no pickle that could run code)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hybrid.checkpoint.folders import CheckpointError, SafeReader


class _IndexedReader(SafeReader):
    """SafeReader that reads the index once and hands the same one to every load (an
    export loads hundreds of times; a large run's index is megabytes of pickle)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class CheckpointTensors:
    """Read access to the tensors of one checkpoint folder (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise CheckpointError(
                f"{self.path} is not a checkpoint (no .metadata); pass a folder written by "
                "hybrid, such as <run_dir>/checkpoints/step_00000100"
            )
        self._reader = _IndexedReader(self.path)
        index = self._reader.read_metadata().state_dict_metadata
        self._layout = {
            key: (tuple(meta.size), meta.properties.dtype)
            for key, meta in index.items()
            if isinstance(meta, TensorStorageMetadata)
        }

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every stored tensor's key, full shape and dtype (nothing but the index read)."""
        return dict(self._layout)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The full tensors of `keys`, read together (a bounded group: the caller picks)."""
        state = {}
        for key in keys:
            if key not in self._layout:
                raise CheckpointError(f"checkpoint {self.path} has no tensor {key!r}")
            shape, dtype = self._layout[key]
            state[key] = torch.empty(shape, dtype=dtype)
        if state:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single ..."
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load(state, storage_reader=self._reader, no_dist=True)
        return state

    def stream(self, keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, full tensor) for each key in order, each read only when asked for and
        released by this generator as soon as the next is asked for."""
        for key in keys:
            tensor = self.read([key])[key]
            yield key, tensor
            del tensor


def checkpoint_tensor_layout(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (full shape, dtype)} of every tensor in the checkpoint at `path`."""
    return CheckpointTensors(path).layout()


def read_checkpoint_tensors(path: str | Path, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The full tensors of `keys` from the checkpoint at `path` (any layout wrote it)."""
    return CheckpointTensors(path).read(keys)
