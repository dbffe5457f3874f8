"""The comparison's jobs: which configurations run (competitors side by side), in which
order each round, and one job run under torchrun with its ranks' JSONs or its failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from benchmarks.compare.common import BenchConfig, JobSpec
from benchmarks.compare.report import Row

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root
WIDTHS = {  # the model shapes compared (vocab 256: the corpus's bytes)
    "57m": {"n_layer": 8, "n_head": 12, "d_model": 768},
    "124m": {"n_layer": 12, "n_head": 12, "d_model": 768},  # gpt2-124m's blocks
}


def plan(bench: BenchConfig, recompute: list[bool], systems: set[str]) -> list[JobSpec]:
    """The configurations, competitors next to each other: ours first in each group."""
    specs = []
    for rc in recompute:

        def job(system: str, dp: int = 1, tp: int = 1, stage: int = 0, rc: bool = rc) -> JobSpec:
            return JobSpec(system, dp, tp, stage, rc, bench)

        specs += [job("ours"), job("plain")]
        for stage in range(4):
            specs += [job("ours", dp=2, stage=stage), job("deepspeed", dp=2, stage=stage)]
            specs += [job("ddp", dp=2), job("floor", dp=2)] if stage == 0 else []
            specs += [job("fsdp2", dp=2, stage=3)] if stage == 3 else []
        specs += [job("ours", tp=2), job("dtensor_tp", tp=2)]
        specs += [job("ours", dp=2, tp=2, stage=3), job("fsdp2_tp", dp=2, tp=2, stage=3)]
    return [s for s in specs if s.system in systems]


def round_order(specs: list[JobSpec], round_index: int) -> list[JobSpec]:
    """The jobs of one round: the planned order in even rounds, reversed in odd ones, so
    that every pair of configurations runs in each order equally often over an even
    number of rounds (A B, B A, A B, ...), and a paired ratio's rounds see both orders."""
    return list(specs) if round_index % 2 == 0 else list(reversed(specs))


def deepspeed_available(python: str) -> tuple[bool, str]:
    probe = subprocess.run(
        [python, "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    if probe.returncode == 0:
        return True, probe.stdout.strip().splitlines()[-1]
    error = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
    return False, f"`import deepspeed` failed under {python}: {error}"


def launch(
    spec: JobSpec,
    python: str,
    out: Path,
    timeout_s: float,
    device: str,
    breakdown: bool = False,
) -> Row | str:
    """Run one job; its rank JSONs, or the reason it failed (the log's last lines).
    `breakdown`: the worker adds one step under MemTracker (compare.breakdown)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(spec.world),
        "-m",
        "benchmarks.compare.worker",
        "--spec",
        spec.to_json(),
        "--out",
        str(out),
        *(["--breakdown"] if breakdown else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU would switch init_distributed to nccl
    log = out / "job.log"
    with open(log, "w") as f:
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = -1
    ranks = sorted(out.glob("rank*.json"))
    if code == 0 and len(ranks) == spec.world:
        return [json.loads(p.read_text()) for p in ranks]
    lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
    # The first exception a rank raised says why; torchrun's own summary does not.
    errors = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)]
    reason = "timed out" if code == -1 else f"exit {code}"
    detail = errors[0] if errors else " / ".join(lines[-3:])
    return f"failed ({reason}): {detail[-300:]}".replace("|", "/")
