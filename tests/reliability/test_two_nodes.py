"""Two nodes simulated on this machine (issue 18): two torchrun launchers, `--nnodes 2`,
c10d rendezvous on localhost, two ranks each, every node in a folder of its own with its
own copy of the corpus and its own cache, as separate machines would have. The commands
are the same on both nodes but for `--node_rank` (relative paths, run from the node's
folder).

What torchrun 2.13 does with them: c10d ignores `--node_rank` (it warns "node_rank is only
used for static rdzv_backend") and numbers the nodes itself, sorted by (host name, launcher
pid); on one host the node that becomes group 0 is whichever launcher has the lower pid.
So the test asks which folder holds metrics.jsonl (global rank 0's) instead of assuming.
`--rdzv_conf is_host=1|0` says which launcher serves the rendezvous store (both would
otherwise try, since "localhost" matches both).

Checked from outside the code: a Python audit hook (tests/two_nodes_cases.AUDIT_HOOK) logs
every file each rank opens under the test's folder and every rename into it. Each node's
token file and BPE tokenizer are renamed into place exactly once, by its local rank 0; no
rank opens anything in the other node's folder; the losses equal a one-node run of the same
layout (4 ranks, dp 4) exactly: fp32 on CPU is deterministic at a fixed layout, and where
a rank's process runs changes no arithmetic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import two_nodes_cases as cases
from small_run import TINY_CONFIG, small_run_overrides

from hybrid.instruments.local_processes import free_port, run_processes

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # a broken data phase hangs the job: fail the test instead
# The same relative paths on every node and in the reference: each run from its own folder.
OVERRIDES = [
    "--config", str(TINY_CONFIG),
    *small_run_overrides(Path("corpus.txt"), Path("cache"), Path("run")),
    "train.steps=4", "train.eval_every=1000", "train.eval_batches=1", "sample.tokens=0",
]  # fmt: skip


def _launch_node(
    node_rank: int, port: int, rdzv_id: str, folder: Path, hook: Path
) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
        "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
        f"--rdzv_id={rdzv_id}", f"--rdzv_conf=is_host={int(node_rank == 0)}",
        "-m", "launch.pretrain", *OVERRIDES,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {
        "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}",
        "TWO_NODES_WATCH": str(folder.parent),
        "TWO_NODES_AUDIT": str(folder.parent / f"audit{node_rank}.log"),
    }
    # A session of its own: a timeout or a failed test ends it and its ranks (_kill).
    return subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants: torchrun starts each rank in a session of its own, so
    killing the launcher's process group would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _kill(launchers: list[subprocess.Popen]) -> list[str]:
    """Kill the launchers still running, with their ranks; the stderr of each."""
    for launcher in launchers:
        if launcher.poll() is None:
            for pid in _tree(launcher.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    errors = []
    for launcher in launchers:
        try:
            errors.append(launcher.communicate(timeout=10)[1] or "")
        except (ValueError, subprocess.TimeoutExpired):  # read already, or stuck
            errors.append("")
    return errors


def _finish(launchers: list[subprocess.Popen], deadline: float) -> list[tuple[int, str]]:
    """(exit code, stderr) of each launcher; all killed, with their ranks, at the deadline."""
    results = []
    try:
        for launcher in launchers:
            _, err = launcher.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append((launcher.returncode, err))
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- node {r}:\n{e[-2000:]}" for r, e in enumerate(_kill(launchers)))
        pytest.fail(f"the two-node job did not end within {TIMEOUT_S} s\n{tails}")
    finally:
        _kill(launchers)
    return results


def test_two_nodes_prepare_their_own_cache_once_and_match_one_node(
    small_corpus: Path, tmp_path: Path
) -> None:
    root = tmp_path.resolve()
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(cases.AUDIT_HOOK)
    folders = [root / "node0", root / "node1", root / "one_node"]
    for folder in folders:
        folder.mkdir()
        shutil.copy(small_corpus, folder / "corpus.txt")  # each machine's own copy
    # The reference first: one node of 4 ranks (forked, modules preloaded). Not meanwhile:
    # its free port could be the one the launchers' store is given.
    reference = run_processes(
        cases.pretrain_losses, 4, OVERRIDES, str(folders[2]), timeout_s=TIMEOUT_S
    )[0]
    port, rdzv_id = free_port(), f"two-nodes-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + TIMEOUT_S
    launchers = [_launch_node(r, port, rdzv_id, folders[r], hook) for r in (0, 1)]
    results = _finish(launchers, deadline)
    for code, err in results:
        assert code == 0, err[-4000:]
    assert "node_rank is only used for static rdzv_backend" in results[1][1]

    # Global rank 0 (metrics.jsonl) is on one of the nodes; the other has no metrics.
    with_metrics = [f for f in folders[:2] if (f / "run" / "metrics.jsonl").is_file()]
    assert len(with_metrics) == 1
    assert len(reference) == 4
    assert cases.metrics_losses(with_metrics[0] / "run") == reference

    for node_rank, folder in enumerate(folders[:2]):
        other = folders[1 - node_rank]
        entries = cases.audit_entries(root / f"audit{node_rank}.log")
        assert len({pid for pid, *_ in entries}) == 2  # both ranks of the node were audited
        # Prepared once on this node, by its local rank 0, into this node's own cache.
        renames = [(rank, path) for _, rank, kind, path in entries if kind == "rename"]
        built = [(rank, p) for rank, p in renames if p.name in ("meta.json", "tokenizer.json")]
        assert sorted((rank, p.name) for rank, p in built) == [
            ("0", "meta.json"),
            ("0", "tokenizer.json"),
        ], renames
        assert all(p.is_relative_to(folder / "cache") for _, p in built)
        # The other node's folder is never touched; the token file is read from this one.
        assert not [p for *_, p in entries if p.is_relative_to(other)]
        opened = {(rank, p.name) for _, rank, kind, p in entries if kind == "open"}
        assert {("0", "tokens.bin"), ("1", "tokens.bin")} <= opened
        (tokens,) = (folder / "cache" / "tokens").glob("*/tokens.bin")
        assert tokens.stat().st_size > 0 and (tokens.parent / "meta.json").is_file()
