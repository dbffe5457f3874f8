"""Helpers for test_two_nodes.py: the file-system audit the launched ranks carry, and
the one-node reference run (a function run_processes forks, so it lives in a module)."""

from __future__ import annotations

import json
import os
from pathlib import Path

# A sitecustomize.py for the ranks' PYTHONPATH: Python's audit hooks (PEP 578) record, from
# inside the interpreter but outside the code under test, every file a process opens under
# TWO_NODES_WATCH and every rename (os.rename, os.replace, Path.replace) into it, one line
# each, to TWO_NODES_AUDIT (one log per launcher: the node that process belongs to).
# os.write has no audit event, so logging never calls the hook again.
AUDIT_HOOK = """
import os
import sys

_log, _root = os.environ.get("TWO_NODES_AUDIT"), os.environ.get("TWO_NODES_WATCH")
if _log and _root:
    _fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _who = f"{os.getpid()} {os.environ.get('LOCAL_RANK', '-')}"

    def _record(kind, path):
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path.startswith(_root):
                os.write(_fd, f"{_who} {kind} {path}\\n".encode())

    def _hook(event, args):
        if event == "open":
            _record("open", args[0])
        elif event == "os.rename":
            _record("rename", args[1])

    sys.addaudithook(_hook)
"""


def audit_entries(log: Path) -> list[tuple[str, str, str, Path]]:
    """(pid, local rank, 'open' | 'rename', path) of each line, the ranks' only (the
    torchrun agent has no LOCAL_RANK)."""
    rows = [line.split(" ", 3) for line in log.read_text().splitlines()]
    return [(pid, rank, kind, Path(path)) for pid, rank, kind, path in rows if rank != "-"]


def metrics_losses(run_dir: Path) -> list[float]:
    """The per-step losses of metrics.jsonl, steps checked to be 1, 2, ..."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


def pretrain_losses(argv: list[str], cwd: str) -> list[float]:
    """(Each rank of run_processes.) `python -m launch.pretrain argv` in `cwd`; rank 0
    returns the losses it wrote."""
    from launch import pretrain

    os.chdir(cwd)  # the same relative data.files, cache_dir and run_dir as a node's
    assert pretrain.main(argv) == 0
    return metrics_losses(Path("run")) if os.environ["RANK"] == "0" else []
