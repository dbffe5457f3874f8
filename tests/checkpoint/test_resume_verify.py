"""Resume verification divided among the ranks (`checkpoint.verify`): each checkpoint file
is hashed by exactly one rank, one all-reduce makes every rank reach the same verdict.

Bytes are counted by the kernel, not by the code under test: `rchar` of /proc/self/io,
the bytes this process got from read() calls (gloo's socket traffic arrives by recv()
and is not in it: a barrier adds nothing, measured). Besides the hashed files, each rank
reads the checksum records (all ranks read all of them, to share one order and split)
and, for sizes, `.metadata` and trainer_state.json; the count around a verification is
those sizes, taken from `stat`, plus the read of /proc/self/io itself, measured on each
rank just before. Tolerance: 16 bytes a rank, for that read's text growing a digit; the
smallest file a rank hashes is 1249 bytes, so one file read twice or skipped would show.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from checkpoint_cases import build
from small_run import TINY_CONFIG

from hybrid.checkpoint.engine_state import load_checkpoint, save_checkpoint
from hybrid.checkpoint.folders import check_checksums
from hybrid.distributed.comm import Group
from hybrid.distributed.env import init_distributed, shutdown
from hybrid.instruments.local_processes import run_processes
from launch.config import ConfigError, load_config, to_dict, valid_keys
from launch.train.checkpointing import resume_candidate, resume_from, verify_resume

WORLD = 4
ALTERED = "__1_0.distcp"  # hashed by rank 1 (the split gives rank 0 the largest shard)
SLACK = 16  # bytes a rank: the /proc/self/io text may grow by a digit between reads


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _counted(call: Any) -> tuple[Any, int]:
    """`call()` and the bytes this process read during it, less the counter's own read.

    In a process group every rank calls it together. The barriers keep the other ranks
    inside the same window: rank 0 hosts the TCP store, whose thread read()s every store
    request another rank sends (creating a group, say), and those bytes count in rank 0's
    rchar."""
    together = dist.barrier if dist.is_initialized() else lambda: None
    own = -_bytes_read() + _bytes_read()
    together()
    before = _bytes_read()
    result = call()
    together()
    read = _bytes_read() - before - own
    together()  # no rank moves on to store requests before every rank has counted
    return result, read


def _config(root: Path, *extra: str) -> Any:
    return load_config(TINY_CONFIG, [f"checkpoint.dir={root}", *extra])


def _outcome(call: Any) -> tuple[Any, str]:
    """(the path chosen or the error's text, what this rank wrote on stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            result = str(call())
        except ConfigError as error:
            result = f"error: {error}"
    return result, err.getvalue()


def _four_ranks(root: Path) -> dict[str, Any]:
    env = init_distributed()
    try:
        engine, _ = build(1, 1, 3)
        older = save_checkpoint(engine, root, 1, {"step": 1}, {}, keep=3)
        newest = root / "step_00000002"
        if env.rank == 0:  # the same files, so the same checksums: a second checkpoint
            shutil.copytree(older, newest)
        dist.barrier()
        full = _config(root, f"checkpoint.resume={newest}")
        candidate = resume_candidate(full)
        chosen, full_bytes = _counted(lambda: verify_resume(full, candidate))
        out: dict[str, Any] = {"chosen": str(chosen), "full_bytes": full_bytes}
        dist.barrier()
        if env.rank == 0:
            shard = newest / ALTERED
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x01  # one bit inside a tensor: same size, would load
            shard.write_bytes(bytes(data))
        dist.barrier()
        out["explicit"] = _outcome(lambda: resume_from(full))
        out["auto"] = _outcome(lambda: resume_from(_config(root)))
        size = _config(root, f"checkpoint.resume={newest}", "checkpoint.verify=size")
        (out["size"], _), out["size_bytes"] = _counted(lambda: _outcome(lambda: resume_from(size)))
        none = _config(root, "checkpoint.verify=none")
        (out["none"], out["none_err"]), out["none_bytes"] = _counted(
            lambda: _outcome(lambda: resume_from(none))
        )
        load_checkpoint(build(1, 1, 99)[0], Path(out["none"]))  # the altered file loads
        return out
    finally:
        shutdown(env)


def _size(path: Path) -> int:
    return path.stat().st_size


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("checkpoints")
    return root, run_processes(_four_ranks, WORLD, root)


def test_full_verification_reads_every_byte_once_across_the_ranks(
    four_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, ranks = four_ranks
    folder = root / "step_00000002"
    records = sum(_size(r) for r in (folder / "checksums").glob("rank*.json"))
    listed = [folder / ".metadata", *folder.glob("*.distcp"), *folder.glob("rng/*.pt")]
    assert len(listed) == 1 + 2 * WORLD
    hashed = sum(_size(f) for f in listed)
    assert all(r["chosen"] == str(folder) for r in ranks)
    read = [r["full_bytes"] for r in ranks]
    assert 0 <= sum(read) - (hashed + WORLD * records) <= SLACK * WORLD, (read, hashed, records)
    largest = max(_size(f) for f in listed)
    # Divided: every rank hashed a share, and none more than greedy list scheduling allows
    # (Graham's bound: the mean load plus (1 - 1/ranks) of the largest file).
    for each in read:
        bound = hashed / WORLD + (1 - 1 / WORLD) * largest
        assert records < each - records <= bound, (read, hashed, largest)


def test_an_altered_file_is_named_alike_on_every_rank(
    four_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, ranks = four_ranks
    altered = root / "step_00000002" / ALTERED
    errors = {r["explicit"][0] for r in ranks}
    assert len(errors) == 1, errors  # the rank that hashed it and the others: one error
    (error,) = errors
    assert error.startswith(f"error: checkpoint.resume: checkpoint file {altered} does not")
    # resume=auto: every rank skips it for the checkpoint before, one warning in all
    assert {r["auto"][0] for r in ranks} == {str(root / "step_00000001")}
    warning = ranks[0]["auto"][1]
    assert f"not resuming from {root / 'step_00000002'}: checkpoint file {altered}" in warning
    assert all(r["auto"][1] == "" for r in ranks[1:])


def test_size_reads_no_shard_and_none_reads_nothing_and_loads_the_altered_file(
    four_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, ranks = four_ranks
    folder = root / "step_00000002"
    index = _size(folder / ".metadata") + _size(folder / "trainer_state.json")
    records = sum(_size(r) for r in (folder / "checksums").glob("rank*.json"))
    for r in ranks:
        assert r["size"] == str(folder)  # sizes only: the altered file passes
        assert 0 <= r["size_bytes"] - (index + records) <= SLACK, r["size_bytes"]
        assert r["none"] == str(folder)
        assert 0 <= r["none_bytes"] <= SLACK
    assert "checkpoint.verify=none" in ranks[0]["none_err"]
    assert "an altered file would load" in ranks[0]["none_err"]
    assert all(r["none_err"] == "" for r in ranks[1:])  # one warning, not one a rank


def test_alone_a_process_hashes_every_file_itself(
    four_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, _ = four_ranks
    folder = root / "step_00000001"  # unaltered
    records = sum(_size(r) for r in (folder / "checksums").glob("rank*.json"))
    listed = [folder / ".metadata", *folder.glob("*.distcp"), *folder.glob("rng/*.pt")]
    # Once first, uncounted: the first call in a worker may import modules lazily, whose
    # files the kernel's rchar would count (seen under xdist: 929 bytes over).
    check_checksums(folder, among=Group.whole_job())
    _, read = _counted(lambda: check_checksums(folder, among=Group.whole_job()))
    assert 0 <= read - (sum(_size(f) for f in listed) + records) <= SLACK


def test_the_command_line_hashes_after_start_up_and_names_the_file(
    four_ranks: tuple[Path, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """launch.pretrain alone (training replaced): the altered file is one error line,
    exit code 2, found after start-up and before training begins."""
    import launch.train.entry
    from launch import pretrain

    root, _ = four_ranks
    trained = []
    monkeypatch.setattr(launch.train.entry, "train", lambda *args: trained.append(args))
    folder = root / "step_00000002"
    argv = ["--config", str(TINY_CONFIG), f"checkpoint.resume={folder}"]
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"checkpoint file {folder / ALTERED} does not match the checksum" in err
    assert len(err.splitlines()) == 1 and not trained
    assert pretrain.main([*argv, "checkpoint.verify=size"]) == 0
    assert trained[0][3] == folder


def test_verify_and_async_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from launch import pretrain

    config = load_config(TINY_CONFIG, ["checkpoint.async=true", "checkpoint.verify=size"])
    assert (config.checkpoint.async_save, config.checkpoint.verify) == (True, "size")
    assert load_config(TINY_CONFIG).checkpoint.verify == "full"
    assert not load_config(TINY_CONFIG).checkpoint.async_save
    assert {"checkpoint.verify", "checkpoint.async"} <= set(valid_keys())
    assert to_dict(config)["checkpoint"]["async"] is True  # config.yaml reads back
    for bad, message in [
        ("checkpoint.verify=fast", "checkpoint.verify='fast' is not allowed; choose one of"),
        ("checkpoint.async=maybe", "checkpoint.async='maybe' must be true or false"),
        ("checkpoint.async_save=true", "did you mean 'checkpoint.async'?"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(TINY_CONFIG, [bad])
    assert pretrain.main(["--config", str(TINY_CONFIG), "checkpoint.verify=fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint.verify='fast' is not allowed; choose one of full|size|none" in err
    assert len(err.splitlines()) == 1
