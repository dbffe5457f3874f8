"""Checkpoint pieces as raw bytes (hybrid.checkpoint.raw), checked against the bytes numpy
gives for the same tensors and against DCP's own writer and reader."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hybrid.checkpoint.chunks import ChunkedTensor, ChunkLoadPlanner, ChunkSavePlanner
from hybrid.checkpoint.folders import SafeReader
from hybrid.checkpoint.raw import RawWriter


def _quiet(call: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():  # "assuming the intent is to ... in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        return call(*args, **kwargs, no_dist=True)


def _state() -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=generator)
    return {
        "w": ChunkedTensor((6, 10), [((0, 0), w[:4]), ((4, 0), w[4:])]),  # two row pieces
        "half": torch.randn(5, 3, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "note": "an object",  # a BYTE_IO item
    }


def test_each_piece_is_its_bytes_and_nothing_else(tmp_path: Path) -> None:
    state = _state()
    _quiet(dcp.save, state, storage_writer=RawWriter(str(tmp_path)), planner=ChunkSavePlanner())
    (shard,) = tmp_path.glob("*.distcp")
    data = shard.read_bytes()
    storage = SafeReader(str(tmp_path)).read_metadata().storage_data
    w = state["w"]
    expected = {
        ("w", (0, 0)): w.pieces[torch.Size((0, 0))],
        ("w", (4, 0)): w.pieces[torch.Size((4, 0))],
        ("half", (0, 0)): state["half"],
        ("step", ()): state["step"],
    }
    tensor_bytes = 0
    for (fqn, offset), tensor in expected.items():
        (info,) = [v for k, v in storage.items() if k.fqn == fqn and tuple(k.offset) == offset]
        want = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert data[info.offset : info.offset + info.length] == want, fqn
        tensor_bytes += len(want)
    (note,) = [v for k, v in storage.items() if k.fqn == "note"]
    assert len(data) == tensor_bytes + note.length  # no zip records, no headers


def test_a_resharded_load_reads_rows_and_columns_of_a_piece(tmp_path: Path) -> None:
    state = _state()
    _quiet(dcp.save, state, storage_writer=RawWriter(str(tmp_path)), planner=ChunkSavePlanner())
    full = torch.cat([state["w"].pieces[torch.Size((0, 0))], state["w"].pieces[(4, 0)]])
    # another layout: rows 2-5 of columns 3-7 (cuts both saved pieces and their columns),
    # a non-contiguous target, and the bf16 tensor read into fp32
    target = torch.zeros(10, 4).t()  # (4, 10) transposed: not contiguous
    into = {
        "w": ChunkedTensor((6, 10), [((2, 3), target[:, :5])]),
        "half": torch.zeros(5, 3, dtype=torch.bfloat16),
        "step": torch.tensor(0, dtype=torch.int64),
    }
    _quiet(dcp.load, into, storage_reader=SafeReader(str(tmp_path)), planner=ChunkLoadPlanner())
    assert torch.equal(target[:, :5], full[2:6, 3:8])
    assert torch.equal(target[:, 5:], torch.zeros(4, 5))
    assert torch.equal(into["half"], state["half"]) and into["step"].item() == 7
    rows = {"w": ChunkedTensor((6, 10), [((1, 0), torch.zeros(4, 10))])}  # whole rows 1-4
    _quiet(dcp.load, rows, storage_reader=SafeReader(str(tmp_path)), planner=ChunkLoadPlanner())
    assert torch.equal(rows["w"].pieces[torch.Size((1, 0))], full[1:5])


def test_checkpoints_of_dcps_own_writer_still_load(tmp_path: Path) -> None:
    """Written before the raw format (each piece a torch.save zip): SafeReader hands those
    pieces to DCP's reader."""
    state = {"a": torch.randn(4, 3), "b": torch.arange(5)}
    _quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    into = {"a": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}
    _quiet(dcp.load, into, storage_reader=SafeReader(str(tmp_path)))
    assert torch.equal(into["a"], state["a"]) and torch.equal(into["b"], state["b"])


def test_dcps_own_reader_refuses_raw_pieces_instead_of_misreading(tmp_path: Path) -> None:
    _quiet(dcp.save, {"a": torch.randn(4, 3)}, storage_writer=RawWriter(str(tmp_path)))
    with pytest.raises(CheckpointException) as caught:
        _quiet(dcp.load, {"a": torch.zeros(4, 3)}, storage_reader=dcp.FileSystemReader(tmp_path))
    # DCP wraps the reader's error: rank -> (error, traceback)
    assert "Unknown extension name='hybrid-raw'" in repr(caught.value.failures)
