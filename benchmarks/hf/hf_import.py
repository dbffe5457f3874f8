"""Memory and time of importing a Hugging Face checkpoint, per rank (issue #17).

    python benchmarks/hf/hf_import.py [--params 1e9 2e8] [--eager-up-to 3e8] [--dtype fp32]

Two models are made locally with transformers, random weights, saved with
save_pretrained in shards of at most 1 GB: a GPT-2 (tied embeddings) and a Llama with
grouped-query attention (4 query heads per kv head, untied output), each of about
`--params` parameters. Each is imported at three layouts, every layout in fresh gloo
processes: tp=1 (one process), tp=2 (2 processes), dp=2 ZeRO-3 (2 processes). Sizes up
to `--eager-up-to` also run the old path, where every rank reads the whole checkpoint
(hf_to_ours(read_hf_weights(folder))), for comparison (at 1B it needs ~8 GB a rank).

What a rank does is what launch.train.loop does before its first step: read_hf_config (the
header checks), open_hf_weights, the model on the meta device, then the Engine's
materialisation of its parameters, bucket by bucket, through the same calls
(hybrid.zero.state.initial_value at stages 0-2, initial_values for the ZeRO-3 shard's
pieces) into the same fp32 storage. The optimizer's moments and the gradient buffers the
Engine allocates alongside are left out: they are the Engine's, not the import's.

Measured by the kernel, in each rank: the peak resident set (VmHWM of /proc/self/status,
reset to the current RSS with `echo 5 > /proc/self/clear_refs` once the process group is
up and the meta model built) above that baseline, until the last parameter is in place;
and the wall time of the import. The model's bytes are the checkpoint's tensor bytes;
a rank's share is the fp32 parameter storage it keeps (1/2 of the model at tp=2 and at
dp=2 ZeRO-3, plus the vocabulary padding).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybrid.instruments.local_processes import run_processes  # noqa: E402

LAYOUTS = (("tp=1", 1, 1, 0), ("tp=2", 2, 2, 0), ("dp=2 ZeRO-3", 2, 1, 3))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (the kernel reports kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def make_model(family: str, params: float, dtype: str, folder: Path) -> dict[str, Any]:
    """A random transformers model of about `params` parameters, saved in <= 1 GB shards."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    d = 2048 if params >= 6e8 else 1024
    if family == "gpt2":
        vocab, per_layer = 50257, 12 * d * d + 13 * d
        layers = max(1, round((params - vocab * d - 1024 * d) / per_layer))
        config = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=d, n_layer=layers,
                            n_head=d // 128, bos_token_id=None, eos_token_id=None)  # fmt: skip
        cls: Any = GPT2LMHeadModel
    else:
        vocab, ffn, heads = 32000, int(2.75 * d), d // 128
        per_layer = 2 * d * d + 2 * d * (d // 4) + 3 * d * ffn + 2 * d
        layers = max(1, round((params - 2 * vocab * d) / per_layer))
        config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=heads // 4, max_position_embeddings=1024,
                             tie_word_embeddings=False)  # fmt: skip
        cls = LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the tied output layer a storage of its own
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    model.to(DTYPES[dtype]).save_pretrained(folder, max_shard_size="1GB")
    files = sorted(folder.glob("*.safetensors"))
    count = sum(p.numel() for p in model.parameters())
    del model
    shard_gb = max(f.stat().st_size for f in files) / 1e9
    return {"params": count, "layers": layers, "d": d, "files": len(files), "shard_gb": shard_gb}


def import_rank(folder: str, tp: int, stage: int, eager: bool) -> dict[str, Any]:
    """In one rank: the peak RSS above the baseline and the time of the import."""
    from hybrid.distributed.env import init_distributed, shutdown
    from hybrid.distributed.topology import Topology
    from hybrid.engine import EngineConfig
    from hybrid.tensor_parallel import TensorParallel
    from hybrid.zero.bucket import build_buckets, max_bucket_numel
    from hybrid.zero.state import initial_value, initial_values
    from models.gpt import GPT
    from models.gpt.hf.folder import hf_to_ours, read_hf_config, read_hf_weights
    from models.gpt.hf.lazy import open_hf_weights

    env = init_distributed()
    try:
        topology = Topology.build(tp)
        group = TensorParallel.from_topology(topology, 0)
        config = read_hf_config(folder)
        model = GPT(config, group, device="meta")
        dp_size, dp_rank = (topology.dp, topology.dp_rank) if stage else (1, 0)
        max_numel = max_bucket_numel(stage, EngineConfig().bucket_mb, 4)
        buckets = build_buckets(model, list(model.blocks), dp_size, dp_rank, max_numel)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        baseline = _status("VmRSS")
        start, cpu = time.perf_counter(), time.process_time()
        if eager:
            model.load_full_state(hf_to_ours(read_hf_weights(folder), config))
        else:
            read_hf_config(folder)  # what every rank checks before it starts
            model.load_full_state(open_hf_weights(folder, config))
        held = []  # what the Engine's materialise fills, in the same order
        for bucket in buckets:
            if stage < 3:
                flat = torch.zeros(bucket.numel)
                for i, (name, p) in enumerate(zip(bucket.names, bucket.params, strict=True)):
                    bucket.view(flat, i).copy_(initial_value(model, name, p))
            else:
                flat = torch.zeros(bucket.shard_numel)
                for i, lo, hi, offset in bucket.pieces():
                    value = initial_values(model, bucket.names[i], bucket.params[i], lo, hi)
                    flat[offset : offset + hi - lo] = value
            held.append(flat)
        model.forget_initial_weights()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        peak = _status("VmHWM") - baseline
        share = sum(t.nbytes for t in held)
        return {"peak": peak, "seconds": seconds, "cpu": cpu, "share": share}
    finally:
        shutdown(env)


def run(folder: Path, eager: bool) -> list[dict[str, Any]]:
    model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    rows = []
    for name, world, tp, stage in LAYOUTS:
        ranks = run_processes(import_rank, world, str(folder), tp, stage, eager, timeout_s=3600)
        peak = max(r["peak"] for r in ranks)
        rows.append({
            "layout": name, "peak": peak, "ratio": peak / model_bytes,
            "share": max(r["share"] for r in ranks) / model_bytes,
            "seconds": max(r["seconds"] for r in ranks), "model_bytes": model_bytes,
            "cpu": max(r["cpu"] for r in ranks),
        })  # fmt: skip
        print(f"{folder.name} {'eager' if eager else 'lazy'} {rows[-1]}", flush=True)
    return rows


def _verdict(label: str, rows: list[dict[str, Any]]) -> str:
    """The issue's two criteria for one model: peak <= 0.6x the model's bytes on every
    rank of the 2-process layouts, and less time per rank at tp=2 than at tp=1."""
    by = {row["layout"]: row for row in rows}
    worst = max(by["tp=2"]["ratio"], by["dp=2 ZeRO-3"]["ratio"])
    one, two = by["tp=1"], by["tp=2"]

    def falls(key: str) -> str:
        return "falls" if two[key] < one[key] else "DOES NOT FALL"

    return (
        f"- {label}: peak {worst:.2f}x the model at tp=2 / dp=2 ZeRO-3 (target <= 0.6: "
        f"{'holds' if worst <= 0.6 else 'FAILS'}); import CPU time {one['cpu']:.1f} s at "
        f"tp=1, {two['cpu']:.1f} s at tp=2 ({falls('cpu')}); wall {one['seconds']:.1f} s, "
        f"{two['seconds']:.1f} s ({falls('seconds')})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[1e9, 2e8])
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument(
        "--eager-up-to", type=float, default=3e8, help="sizes that also run the old path"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "hf" / "hf_import.md")
    args = parser.parse_args(argv)
    lines = [
        "# Hugging Face import: peak memory and time per rank",
        "",
        f"`python benchmarks/hf/hf_import.py --params {' '.join(f'{p:g}' for p in args.params)} "
        f"--eager-up-to {args.eager_up_to:g} --dtype {args.dtype}` (see the script's "
        "docstring for the method). "
        "Peak: the largest rank's VmHWM above its baseline while importing; share: the "
        "fp32 parameter storage that rank keeps; both over the checkpoint's bytes. "
        "Time: the slowest rank's import, wall clock and CPU time (time.process_time: the "
        "work itself; the ranks run one thread each, on 2 CPU cores shared with other jobs, "
        "so the wall clock of 2 ranks also counts waiting for a core).",
        "",
        "| model | path | layout | checkpoint (GB) | peak above baseline (GB) | peak / model "
        "| share / model | import wall (s) | import CPU (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hf-import-") as work:
        for params, family in itertools.product(args.params, ("gpt2", "llama")):
            folder = Path(work) / family
            made = make_model(family, params, args.dtype, folder)
            print(f"{family}: {made}", flush=True)
            label = (
                f"{family} {made['params'] / 1e9:.2f}B ({made['layers']} layers, d {made['d']}, "
                f"{made['files']} files <= {made['shard_gb']:.2f} GB)"
            )
            for path in ("lazy", "eager") if params <= args.eager_up_to else ("lazy",):
                rows = run(folder, path == "eager")
                for row in rows:
                    lines.append(
                        f"| {label} | {path} | {row['layout']} | {row['model_bytes'] / 1e9:.2f} "
                        f"| {row['peak'] / 1e9:.2f} | {row['ratio']:.2f} | {row['share']:.2f} "
                        f"| {row['seconds']:.1f} | {row['cpu']:.1f} |"
                    )
                if path == "lazy":
                    verdicts.append(_verdict(label, rows))
            for f in folder.iterdir():
                f.unlink()
    lines += ["", "Acceptance (lazy path):", "", *verdicts]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
