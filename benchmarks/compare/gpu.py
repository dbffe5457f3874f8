"""The GPU section: single-GPU throughput and MFU of gpt2-1.5b in bf16 at the largest
micro-batch that fits, with and without full recomputation, ours against the same model
under plain PyTorch (the twin in fp32 weights under bf16 autocast, torch's fused AdamW).

Ours is the engine at one process, stage 0, precision bf16 (bf16 weights and gradients,
fp32 master and moments). Each (system, recompute, micro-batch) is its own torchrun job,
so an out-of-memory leaves nothing behind; micro-batches are tried in increasing order
until one does not fit. MFU counts model FLOPs only (models.gpt.flops_per_token, no
recomputation) against the GPU's dense bf16 peak.

Skipped without CUDA. `--gpu-device cpu --gpu-model tiny` runs the same code on the CPU
with a small model, to check it where no GPU is at hand (no MFU then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from launch.observe.mfu import peak_flops
from models.gpt import GPT, GPTConfig, flops_per_token

from .metrics import PeakMeter

ROOT = Path(__file__).resolve().parents[2]


def model_config(name: str) -> GPTConfig:
    if name == "tiny":
        return GPTConfig(n_layer=2, n_head=4, d_model=128, seq_len=128, vocab_size=256)
    # configs/gpt2/gpt2-1.5b.yaml, with GPT-2's vocabulary padded to a multiple of 128.
    return GPTConfig(n_layer=48, n_head=25, d_model=1600, seq_len=1024, vocab_size=50304)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("GPU section")
    group.add_argument("--gpu-model", default="gpt2-1.5b", choices=["gpt2-1.5b", "tiny"])
    group.add_argument("--gpu-micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    group.add_argument("--gpu-steps", type=int, default=10)
    group.add_argument("--gpu-peak-tflops", type=float, help="dense bf16 peak, if not listed")
    group.add_argument("--gpu-device", default="auto", choices=["auto", "cpu"])


# ---- one job --------------------------------------------------------------------------------


def _build(job: dict[str, Any], device: torch.device) -> tuple[Any, Any]:
    """(step function, model) for ours or plain."""
    config = model_config(job["model"])
    bf16 = device.type == "cuda"
    if job["system"] == "ours":
        from hybrid.distributed.topology import Topology
        from hybrid.engine import Engine, EngineConfig
        from hybrid.recompute import Recompute, RecomputePolicy
        from hybrid.tensor_parallel import TensorParallel

        topology = Topology.single()
        tp = TensorParallel.from_topology(topology, 0, device=device)
        policy = RecomputePolicy(Recompute.FULL if job["recompute"] else Recompute.NONE)
        model = GPT(config, tp, policy, seed=0, device="meta")
        engine_config = EngineConfig(
            precision="bf16" if bf16 else "fp32", grad_clip=1.0, weight_decay=0.1
        )
        engine = Engine(model, topology, tp, engine_config, list(model.blocks), device)

        def ours_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step(1e-4)
            return loss.detach()

        return ours_step, model

    from .common import adamw_groups
    from .plain_gpt import PlainGPT

    with torch.device(device):
        model = PlainGPT(config, job["recompute"])
    optimizer = torch.optim.AdamW(
        adamw_groups(list(model.named_parameters()), 0.1), lr=1e-4, betas=(0.9, 0.95), fused=True
    )

    def plain_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        autocast = torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return plain_step, model


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda", 0) if job["device"] == "cuda" else torch.device("cpu")
    config = model_config(job["model"])
    meter = PeakMeter(device)  # the baseline: before the model, as in the CPU comparison
    try:
        step, _ = _build(job, device)
        generator = torch.Generator().manual_seed(0)
        shape = (job["micro_batch"], config.seq_len + 1)
        times = []
        for i in range(2 + job["steps"]):
            batch = torch.randint(0, config.vocab_size, shape, generator=generator).to(device)
            if i == 2:
                meter.start()  # the peak over the timed steps only
            if device.type == "cuda":
                torch.cuda.synchronize()
            tick = time.perf_counter()
            float(step(batch[:, :-1], batch[:, 1:]))  # reading the loss waits for the step
            if i >= 2:
                times.append(time.perf_counter() - tick)
    except torch.OutOfMemoryError:
        return {"oom": True}
    median = statistics.median(times)
    result = {
        "oom": False,
        "step_time": median,
        "tokens_per_s": job["micro_batch"] * config.seq_len / median,
    }
    if device.type == "cuda":
        result["peak_bytes"] = meter.stop()["peak_above_baseline"]
    return result


# ---- the section ----------------------------------------------------------------------------


def _launch(job: dict[str, Any], out: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "benchmarks.compare.gpu", "--job", json.dumps(job), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if job["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-2:]
        # An OOM outside the guarded steps (while building) also ends the search.
        return {"oom": True, "error": " / ".join(tail)[-300:]}
    return json.loads(out.read_text())


def _peak_flops(args: argparse.Namespace) -> float | None:
    """--gpu-peak-tflops, else the training runs' own table (launch.observe.mfu)."""
    return peak_flops(args.gpu_peak_tflops or None, torch.device("cuda", 0))


def section(args: argparse.Namespace) -> list[str]:
    """Markdown lines for results.md: the GPU table, or why it was skipped."""
    device = "cpu" if args.gpu_device == "cpu" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        return ["Skipped: no CUDA device on this machine."]
    config = model_config(args.gpu_model)
    peak = _peak_flops(args) if device == "cuda" else None
    flops = flops_per_token(config)
    lines = [
        f"{args.gpu_model} ({config.n_layer} layers, d_model {config.d_model}, seq "
        f"{config.seq_len}) on {torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'}"
        f", {'bf16' if device == 'cuda' else 'fp32'}; {args.gpu_steps} timed steps at the "
        f"largest micro-batch of {args.gpu_micro_batches} that fits. MFU = "
        f"{flops / 1e9:.2f} GFLOP/token x tokens/s / "
        f"{'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}.",
        "",
        "| system | recompute | micro-batch | step time (ms) | tokens/s | MFU "
        "| peak during the timed steps (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    best: dict[tuple[str, bool], dict[str, Any]] = {}
    with_tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-section-{os.getpid()}"
    for recompute in (False, True):
        for system in ("ours", "plain"):
            for micro in sorted(args.gpu_micro_batches):
                job = {
                    "system": system, "recompute": recompute, "micro_batch": micro,
                    "model": args.gpu_model, "steps": args.gpu_steps, "device": device,
                }  # fmt: skip
                result = _launch(job, with_tmp / f"{system}-{recompute}-{micro}.json")
                print(f"[gpu] {system} recompute={recompute} micro={micro}: {result}", flush=True)
                if result["oom"]:
                    break
                best[system, recompute] = {**result, "micro_batch": micro}
            found = best.get((system, recompute))
            if found is None:
                lines.append(f"| {system} | {recompute} | none fits ||||")
                continue
            mfu = f"{flops * found['tokens_per_s'] / peak:.1%}" if peak else "n/a"
            memory = f"{found['peak_bytes'] / 2**30:.1f}" if "peak_bytes" in found else "n/a"
            lines.append(
                f"| {system} | {'full' if recompute else 'none'} | {found['micro_batch']} "
                f"| {found['step_time'] * 1e3:.0f} | {found['tokens_per_s']:,.0f} | {mfu} "
                f"| {memory} |"
            )
    for recompute in (False, True):
        ours, plain = best.get(("ours", recompute)), best.get(("plain", recompute))
        if ours and plain:
            lines.append(
                f"\nOurs / plain tokens/s, recompute {'full' if recompute else 'none'}: "
                f"{ours['tokens_per_s'] / plain['tokens_per_s']:.3f}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="one GPU-section job")
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run_job(json.loads(args.job))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
