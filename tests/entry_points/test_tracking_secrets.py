"""W&B never costs the run and never leaks the API key: an unreachable server is one
warning and the run finishes; the key set in the environment appears in no file of the run
folder (configs, metrics, the offline W&B run) and in nothing printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from small_run import TINY_CONFIG, small_run_overrides

ROOT = Path(__file__).resolve().parents[2]
KEY = "hybridtest" + "0123456789" * 3  # 40 characters, the length of a real W&B key


def _pretrain(overrides: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    environ |= {"PYTHONPATH": str(ROOT), "WANDB_API_KEY": KEY, **env}
    command = [sys.executable, "-m", "launch.pretrain", "--config", str(TINY_CONFIG)]
    return subprocess.run(
        [*command, *overrides], cwd=cwd, env=environ, capture_output=True, text=True, timeout=240
    )


def _files_holding(folder: Path, text: str) -> list[Path]:
    needle = text.encode()
    return [p for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_unreachable_wandb_is_a_warning_and_the_key_leaks_nowhere(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    base = [*small_run_overrides(small_corpus, cache_dir, tmp_path / "x"), "train.steps=2"]
    online = tmp_path / "online"
    result = _pretrain(
        [*base, f"run_dir={online}", "tracking.wandb.mode=online",
         "tracking.wandb.init_timeout_s=3"],
        tmp_path,
        WANDB_BASE_URL="http://127.0.0.1:9",  # nothing listens there
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "W&B could not start" in result.stderr and "Traceback" not in result.stderr
    assert "done: 2 steps" in result.stdout

    offline = tmp_path / "offline"
    result2 = _pretrain([*base, f"run_dir={offline}", "tracking.wandb.mode=offline"], tmp_path)
    assert result2.returncode == 0, result2.stderr[-3000:]
    assert list((offline / "wandb").glob("offline-run-*/run-*.wandb"))
    for out in (result, result2):
        assert KEY not in out.stdout + out.stderr
    assert _files_holding(online, KEY) == [] and _files_holding(offline, KEY) == []
    assert _files_holding(offline, "hybridtest") == []
