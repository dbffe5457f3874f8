"""Memory of the streamed conversions, measured from outside the code under test.

    python benchmarks/hf/hf_export.py [--size tiny|small|1b] [--families gpt2 llama]
        [--shard-sizes 1GB 200MB] [--skip-logits] [--skip-run] [--out benchmarks/hf/hf_export.md]

1. `launch.convert --to-hf` of a model's checkpoint, per family and max shard size, each
   in a fresh process: its peak resident set (VmHWM, /proc/self/status) above its
   resident set just before the export (the high-water mark reset there by writing 5 to
   /proc/self/clear_refs, after the imports), against the largest shard file it wrote
   (st_size). Acceptance: at most 2x. The imports the export makes on first use
   (transformers' config classes, DCP) are made before the baseline. The checkpoint
   comes from `--from-hf` (no Adam moments: the export never reads them) of a Hugging
   Face folder of random weights, itself written by the streamed writer, so no step here
   holds the model; `--from-hf`'s own peak is measured the same way. Then transformers'
   `from_pretrained` loads the export, and its logits are compared with our GPT's on
   the same tokens (fp32).
2. The end of a fine-tuning run at tp=2 x dp=2, ZeRO stage 3 (4 local processes, gloo,
   a small Llama): each rank's peak resident set while `write_final_weights` streams the
   Hugging Face export, against the same rank's peak over the run before it (both
   absolute VmHWM: the export's after resetting the mark at its start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIZES = {  # GPT-2 and a Llama with grouped-query attention, per size
    "tiny": {
        "gpt2": dict(n_layer=2, n_head=4, d_model=256, seq_len=128, vocab_size=5003),
        "llama": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=256, d_ff=704, vocab_size=5003),
    },
    "small": {
        "gpt2": dict(n_layer=6, n_head=8, d_model=768, seq_len=512, vocab_size=50257),
        "llama": dict(n_layer=6, n_head=12, n_kv_head=4, d_model=768, d_ff=2048, vocab_size=32000),
    },
    "1b": {
        "gpt2": dict(n_layer=18, n_head=16, d_model=2048, seq_len=1024, vocab_size=50257),
        "llama": dict(n_layer=18, n_head=32, n_kv_head=8, d_model=2048, d_ff=5632,
                      vocab_size=32000),
    },
}  # fmt: skip
LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", tie_embeddings=False, bias=False)

# Runs one conversion in this fresh process and prints its peak RSS above the baseline.
MEASURE = """
import json, sys, time
sys.path.insert(0, {root!r})
from launch import convert  # the imports are in the baseline, with those made on first use
import torch.distributed.checkpoint
from transformers import GPT2Config, LlamaConfig

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark := the current resident set
baseline = status("VmRSS")
tick = time.perf_counter()
code = convert.main({args!r})
print(json.dumps({{"code": code, "peak_above": status("VmHWM") - baseline,
                  "baseline": baseline, "seconds": time.perf_counter() - tick}}))
"""


def gpt_config(family: str, size: str):  # -> GPTConfig
    from models.gpt import GPTConfig

    fields = dict(SIZES[size][family], dropout=0.0)
    if family == "llama":
        fields |= LLAMA | {"seq_len": 2048}
    return GPTConfig(**fields)


def random_hf_folder(folder: Path, family: str, size: str) -> int:
    """A Hugging Face folder of random weights, written tensor by tensor; its parameters."""
    import torch

    from models.gpt import GPT
    from models.gpt.hf.export import source_order, write_hf_export

    config = gpt_config(family, size)
    shapes = {n: tuple(p.shape) for n, p in GPT(config, device="meta").named_parameters()}
    names = source_order(config)
    layout = [(n, shapes[n], torch.float32) for n in names]
    generator = torch.Generator().manual_seed(0)

    def tensors():
        for name in names:
            noise = torch.randn(shapes[name], generator=generator) * 0.02
            yield name, noise + 1 if "ln" in name and name.endswith("weight") else noise

    write_hf_export(folder, config, layout, tensors(), max_shard_size="2GB")
    return sum(torch.Size(s).numel() for s in shapes.values())


def measured(args: list[str]) -> dict:
    script = MEASURE.format(root=str(ROOT), args=args)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{args} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1])
    if result["code"] != 0:
        raise RuntimeError(f"{args} exited {result['code']}:\n{out.stderr[-2000:]}")
    return result


def largest_tensor(files: list[Path]) -> int:
    """The bytes of the largest tensor in the safetensors files (from their headers)."""
    import struct

    largest = 0
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                largest = max(largest, entry["data_offsets"][1] - entry["data_offsets"][0])
    return largest


def logits_error(export: Path, original: Path, family: str, size: str) -> float:
    """max |from_pretrained(export) - our GPT on the original folder| / max |ours|."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.gpt import GPT
    from models.gpt.hf.lazy import open_hf_weights

    config = gpt_config(family, size)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = GPT(config, init_weights=open_hf_weights(original, config)).eval()(ids)
        theirs = AutoModelForCausalLM.from_pretrained(str(export)).eval()(ids).logits
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def export_section(work: Path, size: str, families: list[str], shard_sizes: list[str],
                   logits: bool) -> list[str]:  # fmt: skip
    rows, notes = [], []
    for family in families:
        hf = work / f"hf-{family}"
        params = random_hf_folder(hf, family, size)
        root = work / f"ck-{family}"
        imported = measured(["--from-hf", str(hf), "--out", str(root)])
        checkpoint = root / "step_00000000"
        model_bytes = (checkpoint / "__0_0.distcp").stat().st_size
        notes.append(
            f"- {family} ({params / 1e9:.2f}B parameters): `--from-hf` peak "
            f"{imported['peak_above'] / 2**20:.0f} MiB above baseline for a "
            f"{model_bytes / 2**20:.0f} MiB checkpoint ({imported['seconds']:.0f} s)"
        )
        for shard in shard_sizes:
            out = work / f"out-{family}-{shard}"
            result = measured(
                ["--to-hf", str(out), "--checkpoint", str(checkpoint), "--max-shard-size", shard]
            )
            files = sorted(out.glob("*.safetensors"))
            largest = max(f.stat().st_size for f in files)
            tensor = largest_tensor(files)
            ratio = result["peak_above"] / largest
            error = logits_error(out, hf, family, size) if logits else float("nan")
            rows.append(
                f"| {family} | {params / 1e9:.2f}B | {shard} | {len(files)} | "
                f"{largest / 2**20:.0f} | {tensor / 2**20:.0f} | "
                f"{result['peak_above'] / 2**20:.0f} | {ratio:.2f} | "
                f"{'yes' if ratio <= 2 else 'NO'} | {error:.1e} | {result['seconds']:.0f} |"
            )
            shutil.rmtree(out)
        shutil.rmtree(root)
        shutil.rmtree(hf)
    head = [
        "| family | parameters | max shard | files | largest file (MiB) | largest tensor "
        "(MiB) | peak above baseline (MiB) | peak / largest file | <= 2x | logits rel. "
        "error | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    return head + rows + [""] + notes


# -- the end of a tp=2 x dp=2 stage-3 fine-tuning run --------------------------------------


def _rank_peaks(overrides: list[str]) -> dict:
    """One rank of the fine-tuning run; its training and export peaks (VmHWM)."""
    import launch.train.loop as training
    from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
    from launch.finetune import read_finetune_config
    from launch.train.entry import check_before_start

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    peaks: dict = {}
    original = training.write_final_weights

    def measured_export(*args, **kwargs):  # the run's own function, bracketed
        peaks["training_peak"] = status("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        peaks["export_start_rss"] = status("VmRSS")
        original(*args, **kwargs)
        peaks["export_peak"] = status("VmHWM")

    training.write_final_weights = measured_export
    env = init_distributed()
    try:
        config = read_finetune_config(str(ROOT / "configs" / "finetune.yaml"), overrides)
        dp = check_before_start(config, world_size_from_env())
        training.train(config, env, dp, None)
    finally:
        shutdown(env)
    return peaks


def run_section(work: Path) -> list[str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid.instruments.local_processes import run_processes
    from launch.data.token_file import BUNDLED_CORPUS, iter_documents
    from launch.data.tokenizers import train_bpe_tokenizer

    cache = work / "cache"
    tokenizer = train_bpe_tokenizer(
        lambda: iter_documents([BUNDLED_CORPUS], "text", cache), 512, "bench", cache
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    folder = work / "llama"
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    overrides = [
        f"init_from={folder}", f"data.cache_dir={cache}", f"run_dir={work / 'run'}",
        "parallel.tp=2", "parallel.zero_stage=3", "train.steps=2", "train.seq_len=128",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=2",
        "train.eval_batches=1",
        "sample.tokens=0", "tracking.wandb.mode=disabled",
    ]  # fmt: skip
    ranks = run_processes(_rank_peaks, 4, overrides, timeout_s=900)
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    rows = [
        f"Fine-tuning a {params / 1e6:.0f}M-parameter Llama (GQA 8/2 heads) for 2 steps at "
        "tp=2 x dp=2, ZeRO stage 3, then the Hugging Face export at the end of the run:",
        "",
        "| rank | training peak (MiB) | export peak (MiB) | export start (MiB) | within |",
        "|---:|---:|---:|---:|---|",
    ]
    for rank, p in enumerate(ranks):
        ok = p["export_peak"] <= p["training_peak"]
        rows.append(
            f"| {rank} | {p['training_peak'] / 2**20:.0f} | {p['export_peak'] / 2**20:.0f} | "
            f"{p['export_start_rss'] / 2**20:.0f} | {'yes' if ok else 'NO'} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--shard-sizes", nargs="+", default=["1GB", "200MB"])
    parser.add_argument("--skip-logits", action="store_true")
    parser.add_argument("--skip-run", action="store_true", help="no end-of-run section")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "hf" / "hf_export.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hf-export-", dir=args.work))
    tick = time.time()
    try:
        lines = [
            "# Streamed Hugging Face export: memory",
            "",
            f"`python benchmarks/hf/hf_export.py --size {args.size} --families "
            f"{' '.join(args.families)} --shard-sizes {' '.join(args.shard_sizes)}`"
            f" on {platform.machine()}, {os.cpu_count()} CPUs (torch CPU, fp32).",
            "",
            "## `launch.convert --to-hf` (one process, fresh per row)",
            "",
            *export_section(work, args.size, args.families, args.shard_sizes, not args.skip_logits),
        ]
        if not args.skip_run:
            lines += [
                "",
                "## Export at the end of a tp=2 x dp=2 stage-3 run",
                "",
                *run_section(work),
            ]
        lines += ["", f"Wall time {time.time() - tick:.0f} s.", ""]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
