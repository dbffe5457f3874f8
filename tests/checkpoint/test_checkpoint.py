"""Checkpoints: saved at one layout, loaded at another with identical states; training
continues as if never stopped. Damaged checkpoints are named before anything loads, and a
failed save never costs the last good checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import zero_cases
from checkpoint_cases import run
from small_run import TINY_CONFIG, small_run_overrides

import hybrid.checkpoint.engine_state
from hybrid.checkpoint.engine_state import load_checkpoint, save_checkpoint
from hybrid.checkpoint.folders import CheckpointError, check_checkpoint, find_latest
from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.instruments.local_processes import run_processes
from hybrid.tensor_parallel import TensorParallel
from launch.config import ConfigError, load_config, validate_layout
from launch.pretrain import train
from launch.train.checkpointing import resume_from
from models.gpt import GPT


def test_reshard_tp2_dp2_stage3_to_other_layouts(tmp_path: Path) -> None:
    reference = run_processes(run, 1, 1, 0, range(12))[0]["losses"]
    saved = run_processes(run, 4, 2, 3, range(10), None, tmp_path, True)[0]
    assert saved["losses"] == pytest.approx(reference[:10], rel=1e-5)
    checkpoint = tmp_path / "step_00000010"
    for world, tp, stage in [(4, 1, 1), (4, 4, 0), (1, 1, 0), (2, 1, 2)]:
        loaded = run_processes(run, world, tp, stage, range(10, 12), checkpoint)[0]
        assert loaded["loaded"].keys() == saved["saved"].keys()
        for key, tensor in saved["saved"].items():
            assert torch.equal(loaded["loaded"][key], tensor), (world, tp, stage, key)
        assert loaded["losses"] == pytest.approx(reference[10:12], rel=1e-5), (world, tp, stage)


def _stop_and_resume(corpus: Path, cache: Path, root: Path, extra: list[str]) -> dict:
    """In one process group: 20 steps straight, and 10 steps + a resumed run to 20, with
    dropout, so the resumed losses match only if the random state was restored too. Per
    run, the steps it ran itself (`train`'s own history): a rerun that missed its
    checkpoint would run steps 1-20 again and give the same losses."""
    env = init_distributed()
    try:
        losses, ran = {}, []
        for name, more in [("straight", []), ("resumed", ["train.stop_at=10"]), ("resumed", [])]:
            overrides = small_run_overrides(corpus, cache, root / name) + extra + more
            overrides += ["train.steps=20", "train.eval_every=20", "sample.tokens=0"]
            overrides += ["model.dropout=0.1"]
            config = load_config(TINY_CONFIG, overrides)
            dp = validate_layout(config, world_size_from_env())
            history = train(config, env, dp, resume_from(config))
            ran.append([row["step"] for row in history])
            metrics = Path(config.run_dir) / "metrics.jsonl"
            losses[name] = [json.loads(line)["loss"] for line in metrics.open()]
        return losses | {"ran": ran}
    finally:
        shutdown(env)


@pytest.mark.parametrize(
    ("world", "extra"),
    [
        (4, ["parallel.tp=2", "parallel.zero_stage=3", "parallel.sequence_parallel=true"]),
        (2, ["parallel.zero_stage=1"]),
    ],
    ids=["tp2-dp2-zero3", "dp2-zero1"],
)
def test_stopped_and_resumed_run_has_the_same_losses(
    world: int, extra: list[str], small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    losses = run_processes(_stop_and_resume, world, small_corpus, cache_dir, tmp_path, extra)[0]
    steps = list(range(1, 21))
    assert losses["ran"] == [steps, steps[:10], steps[10:]]  # the rerun began at step 11
    assert len(losses["straight"]) == len(losses["resumed"]) == 20
    assert losses["resumed"] == losses["straight"]  # exactly: fp32 on CPU is deterministic
    checkpoints = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_00000010", "step_00000020"]


def test_resume_from_a_folder_that_is_not_a_checkpoint_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch import pretrain

    code = pretrain.main(["--config", str(TINY_CONFIG), f"checkpoint.resume={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "is not a complete checkpoint" in err and str(tmp_path) in err
    assert len(err.splitlines()) == 1


class _Payload:
    """Unpickling this would run a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_crafted_checkpoint_index_is_refused_without_running_it(tmp_path: Path) -> None:
    import pickle

    from hybrid.checkpoint.folders import CheckpointError, SafeReader

    marker = tmp_path / "pwned"
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"posix\.system|os\.system"):
        SafeReader(str(folder)).read_metadata()
    assert not marker.exists()
    pickle.loads((folder / ".metadata").read_bytes())  # the payload is real: it does run
    assert marker.exists()


def _single_engine(seed: int) -> Engine:
    topology = Topology.single()
    model = GPT(zero_cases.CONFIG, seed=seed)
    return Engine(model, topology, TensorParallel.from_topology(topology, seed), EngineConfig())


def test_missing_or_truncated_shard_is_named_before_loading(tmp_path: Path) -> None:
    saved = save_checkpoint(_single_engine(1), tmp_path, 1, {"step": 1}, {}, keep=1)
    shard = next(saved.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"shard {shard} is truncated"):
        load_checkpoint(_single_engine(2), saved)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard} is missing"):
        check_checkpoint(saved)
    shard.write_bytes(data)
    load_checkpoint(_single_engine(2), saved)  # restored: it loads again


def test_a_failed_save_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that dies after writing part of its shards (keep=1, so pruning would delete
    the good one if it ran) leaves the previous checkpoint, its pointer and its bytes."""
    engine = _single_engine(1)
    good = save_checkpoint(engine, tmp_path, 1, {"step": 1}, {}, keep=1)
    before = {p.name: p.read_bytes() for p in good.iterdir() if p.is_file()}

    def dies_mid_write(state_dict: dict, storage_writer: Any, **kwargs: Any) -> None:
        (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(hybrid.checkpoint.engine_state.dcp, "save", dies_mid_write)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(engine, tmp_path, 2, {"step": 2}, {}, keep=1)
    assert find_latest(tmp_path) == good
    assert (tmp_path / "latest").read_text() == good.name
    assert {p.name: p.read_bytes() for p in good.iterdir() if p.is_file()} == before
    monkeypatch.undo()
    load_checkpoint(_single_engine(2), find_latest(tmp_path))


def test_auto_resume_skips_a_damaged_newest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = _single_engine(1)
    first = save_checkpoint(engine, tmp_path, 1, {"step": 1}, {}, keep=3)
    second = save_checkpoint(engine, tmp_path, 2, {"step": 2}, {}, keep=3)
    config = load_config(TINY_CONFIG, [f"checkpoint.dir={tmp_path}"])
    assert resume_from(config) == second
    for folder in (second, first):
        shard = next(folder.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        if folder == second:
            assert resume_from(config) == first
            assert f"not resuming from {second}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"no checkpoint in {tmp_path} can be loaded"):
        resume_from(config)


def test_an_altered_shard_is_named_by_its_checksum(tmp_path: Path) -> None:
    saved = save_checkpoint(_single_engine(1), tmp_path, 1, {"step": 1}, {}, keep=1)
    assert (saved / "checksums" / "rank0.json").is_file()
    check_checkpoint(saved)
    shard = next(saved.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: same size, loads silently
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard} does not match the checksum"):
        check_checkpoint(saved)


def test_a_checkpoint_of_another_model_size_is_refused_by_name(
    small_corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch import pretrain

    base = [*small_run_overrides(small_corpus, cache_dir, tmp_path / "a"), "sample.tokens=0"]
    assert pretrain.main(["--config", str(TINY_CONFIG), *base, "train.steps=2"]) == 0
    saved = tmp_path / "a" / "checkpoints" / "step_00000002"
    other = [*small_run_overrides(small_corpus, cache_dir, tmp_path / "b"), "model.n_layer=3"]
    code = pretrain.main(["--config", str(TINY_CONFIG), *other, f"checkpoint.resume={saved}"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"checkpoint {saved} holds another model (model.n_layer: 2 there, 3 here)" in err
