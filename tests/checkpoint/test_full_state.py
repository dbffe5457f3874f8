"""End-of-run weights: a safetensors file written tensor by tensor (read back by the
safetensors package), and a ZeRO-3 engine that streams it without ever holding more than
one bucket and one full parameter (measured by MemTracker)."""

from __future__ import annotations

from pathlib import Path

import full_state_cases
import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint.full_state import write_safetensors
from hybrid.instruments.local_processes import run_processes
from models.gpt import GPT


def test_streamed_file_reads_back_with_the_safetensors_package(tmp_path: Path) -> None:
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bias": torch.randn(7).to(torch.bfloat16),
        "c": torch.randn(2, 2, 3).to(torch.float16),
        "steps": torch.arange(4),
        "scalar": torch.tensor(2.5),
    }
    layout = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_safetensors(tmp_path / "w.safetensors", layout, tensors.items())
    back = load_file(tmp_path / "w.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_a_stream_that_does_not_match_its_layout_leaves_no_file(tmp_path: Path) -> None:
    layout = [("a", (2,), torch.float32), ("b", (3,), torch.float32)]
    target = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match="arrived where the layout has"):
        write_safetensors(target, layout, [("a", torch.zeros(2)), ("b", torch.zeros(4))])
    with pytest.raises(ValueError, match="ended before tensor b"):
        write_safetensors(target, layout, [("a", torch.zeros(2))])
    assert not target.exists()


@pytest.mark.parametrize("tp", [1, 2])
def test_stage3_streams_the_weights_one_bucket_at_a_time(tmp_path: Path, tp: int) -> None:
    path = tmp_path / "model.safetensors"
    for rank, run in enumerate(
        run_processes(full_state_cases.stream_weights, 2 * tp, tp, str(path))
    ):
        # One gathered bucket, plus one parameter at a time: its TP gather (the local
        # slice made contiguous along the split dimension, the gathered tensor) and the
        # contiguous copy that is written.
        bound = run["bucket"] + 3 * run["parameter"]
        assert run["added"] <= 1.05 * bound, (rank, run)
        assert bound < run["model"] / 2  # the bound is well below the whole model
    reference = GPT(full_state_cases.CONFIG, seed=full_state_cases.SEED).state_dict()
    written = load_file(path)
    assert written.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(written[name], tensor), name
