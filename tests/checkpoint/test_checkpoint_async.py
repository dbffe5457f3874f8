"""Checkpoint saves without ShardedTensor, hashed as they are written, and in the
background (checkpoint.async): counted and compared from outside the code under test."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zero_cases
from checkpoint_async_cases import (
    count_save_collectives,
    independent_checksum,
    save_while_training,
)

from hybrid.checkpoint.engine_state import load_checkpoint, save_checkpoint
from hybrid.checkpoint.folders import CheckpointError, check_checksums
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.instruments.local_processes import run_processes
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT


def test_a_save_costs_a_few_collectives_not_one_per_key(tmp_path: Path) -> None:
    """Counted at torch.distributed's functions: DCP's plan exchange only. ShardedTensor
    cost an object all-gather per key (3 per parameter)."""
    ranks = run_processes(count_save_collectives, 2, str(tmp_path))
    for rank in ranks:
        assert rank["keys"] >= 60
        assert 1 <= len(rank["collectives"]) <= 6, rank


def test_no_deprecated_sharded_tensor(tmp_path: Path) -> None:
    engine = _engine(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=FutureWarning)
        warnings.filterwarnings("error", category=DeprecationWarning)
        saved = save_checkpoint(engine, tmp_path, 1, {"step": 1}, {}, keep=1)
        load_checkpoint(_engine(2), saved)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_holds_the_state_of_its_step_while_training_goes_on(
    tmp_path: Path, asynchronous: bool
) -> None:
    """Two more steps run while the checkpoint of step 2 is written; loading it gives the
    state of step 2 exactly (a copy staged before the save returned, not the live
    tensors), and every recorded checksum equals the file's, hashed again from disk."""
    ranks = run_processes(save_while_training, 2, str(tmp_path), asynchronous)
    for rank in ranks:
        assert rank["checksums_match"] and all(rank["checksums_match"].values())
        assert rank["loaded"].keys() == rank["at_save"].keys()
        for key, value in rank["at_save"].items():
            assert torch.equal(rank["loaded"][key], value), key
        moved = [
            k for k in rank["at_save"] if not torch.equal(rank["later"][k], rank["at_save"][k])
        ]
        assert moved  # training did go on while the save was written


def test_a_checkpoint_without_moments_loads_with_fresh_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written by plain DCP with only the `model.*` tensors (as launch.convert --from-hf
    writes by default): the weights load, Adam's moments start at zero, a warning says so."""
    source = _engine(1)
    weights = {f"model.{k}": v for k, v in source.full_state_dict().items()}
    folder = tmp_path / "step_00000000"
    dcp.save(weights, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    (folder / "trainer_state.json").write_text("{}")
    target = _engine(2)
    target.states[0].exp_avg.fill_(1.0)
    load_checkpoint(target, folder)
    assert "holds no optimizer states" in capsys.readouterr().err
    for name, value in target.full_state_dict().items():
        assert torch.equal(value, source.full_state_dict()[name]), name
    assert all(not s.exp_avg.any() and not s.exp_avg_sq.any() for s in target.states)

    del weights["model.ln_f.weight"]
    partial = tmp_path / "partial"
    dcp.save(weights, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
    (partial / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no tensor 'model.ln_f.weight'"):
        load_checkpoint(_engine(2), partial)


def test_digests_taken_while_writing_equal_the_files(tmp_path: Path) -> None:
    saved = save_checkpoint(_engine(1), tmp_path, 1, {"step": 1}, {}, keep=1)
    shard = next(saved.glob("*.distcp"))
    record = (saved / "checksums" / "rank0.json").read_text()
    assert independent_checksum(shard) in record


def _engine(seed: int) -> Engine:
    topology = Topology.single()
    model = GPT(zero_cases.CONFIG, seed=seed)
    return Engine(model, topology, TensorParallel.from_topology(topology, seed), EngineConfig())


def test_a_checkpoint_with_older_sha256_records_still_verifies(tmp_path: Path) -> None:
    """Checkpoints written before the checksums were xxh3 recorded bare SHA-256 digests."""
    saved = save_checkpoint(_engine(1), tmp_path, 1, {"step": 1}, {}, keep=1)
    record = saved / "checksums" / "rank0.json"
    sums = json.loads(record.read_text())
    old = {name: hashlib.sha256((saved / name).read_bytes()).hexdigest() for name in sums}
    record.write_text(json.dumps(old))
    check_checksums(saved)
    shard = next(saved.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        check_checksums(saved)
