"""Peak memory per rank of a whole fine-tuning step that imports a Hugging Face
checkpoint, against the same step from random weights (issue #17).

    python benchmarks/hf/hf_finetune_step.py [--params 1e9] [--families gpt2 llama]

The models are benchmarks/hf/hf_import.py's: a GPT-2 and a Llama with grouped-query
attention of about `--params` parameters, random weights, saved with save_pretrained in
shards of at most 1 GB. Each rank runs what launch.train.loop.train runs, through the same
functions: `read_finetune_config` of configs/finetune.yaml with `init_from=<folder>`,
PeakMemory's baseline, `build_model` on the meta device (the lazy HF reader), the Engine
(which materialises this rank's shard, reading the checkpoint), then one
`launch.train.step.train_step` on random tokens (forward, backward, gradient reduction, the
AdamW update). The reference run is the same with `build_model(..., resume=True)`: the
same model with random weights, nothing read from the checkpoint. Layouts: tp=2, and
dp=2 at ZeRO stage 3, in fresh gloo processes; fp32.

Measured by the kernel in each rank: VmHWM of /proc/self/status above the baseline
(PeakMemory resets the high-water mark there), read when the Engine is built ("import":
every parameter is in place; Adam's moments and the gradient buffers are zeros the
kernel has not yet given pages) and after the step ("step"). The model's bytes are the
checkpoint's tensor bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "hf"))

from hf_import import make_model  # noqa: E402

from hybrid.instruments.local_processes import run_processes  # noqa: E402

LAYOUTS = (("tp=2", 2, 0), ("dp=2 ZeRO-3", 1, 3))
SEQ = 64  # tokens a sequence: a short step, its activations small beside the model


def step_rank(folder: str, tp: int, stage: int, imported: bool) -> dict[str, Any]:
    import torch

    from hybrid.distributed.env import init_distributed, shutdown
    from hybrid.distributed.topology import Topology
    from hybrid.engine import Engine
    from hybrid.tensor_parallel import TensorParallel
    from launch.finetune import read_finetune_config
    from launch.observe.peak_memory import PeakMemory
    from launch.train.setup import build_model, engine_config
    from launch.train.step import train_step

    env = init_distributed()
    try:
        dp = env.world_size // tp
        overrides = [
            f"init_from={folder}",
            f"parallel.tp={tp}",
            f"parallel.zero_stage={stage}",
            f"train.seq_len={SEQ}",
            "train.micro_batch_size=1",
            f"train.global_batch_size={dp}",
            "train.precision=fp32",
        ]
        config = read_finetune_config(str(ROOT / "configs" / "finetune.yaml"), overrides)
        topology = Topology.build(tp, env.device.type)
        group = TensorParallel.from_topology(topology, 0, False, env.device)
        vocab = config.model.vocab_size
        memory = PeakMemory(env.device)
        model = build_model(config, vocab, group, "meta", resume=not imported)
        engine = Engine(
            model, topology, group, engine_config(config, dp), list(model.blocks), env.device
        )
        model.forget_initial_weights()
        after_import = memory.local()
        tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
        loss, _, _ = train_step(engine, [tokens], 1e-5, env.device)
        return {"import": after_import, "step": memory.local(), "loss": loss}
    finally:
        shutdown(env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama"])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "hf" / "hf_finetune_step.md"
    )
    args = parser.parse_args(argv)
    lines = [
        "# A fine-tuning step that imports a Hugging Face checkpoint: peak memory per rank",
        "",
        f"`python benchmarks/hf/hf_finetune_step.py --params {args.params:g} --families "
        f"{' '.join(args.families)}` (method in the script's docstring). Peak: the largest "
        "rank's VmHWM above the run's baseline, in GB and over the checkpoint's bytes; "
        "'import' is read once the Engine holds every parameter, 'step' after one whole "
        "training step. 'random' is the same run with random weights, no checkpoint read. "
        "Once built, the Engine holds its shard of the weights and the gradient buffers and "
        "Adam moments it zero-fills (at these layouts 1-1.5x the model's bytes besides the "
        "weights), so the import's own cost is the difference to the random-weights run; "
        "benchmarks/hf/hf_import.md measures the import alone.",
        "",
        "| model | layout | checkpoint (GB) | import: peak (GB) | import, random weights "
        "(GB) | import: imported - random (GB) | step: peak (GB) | step, random weights (GB) "
        "| step: imported - random (GB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="hf-step-") as work:
        for family in args.families:
            folder = Path(work) / family
            made = make_model(family, args.params, "fp32", folder)
            model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            label = f"{family} {made['params'] / 1e9:.2f}B ({made['files']} files)"
            for name, tp, stage in LAYOUTS:
                runs = {}
                for imported in (True, False):
                    ranks = run_processes(
                        step_rank, 2, str(folder), tp, stage, imported, timeout_s=3600
                    )
                    runs[imported] = {k: max(r[k] for r in ranks) for k in ("import", "step")}
                    print(f"{label} {name} imported={imported} {ranks}", flush=True)
                got, ref = runs[True], runs[False]
                extra = {k: got[k] - ref[k] for k in ("import", "step")}
                lines.append(
                    f"| {label} | {name} | {model_bytes / 1e9:.2f} | {got['import'] / 1e9:.2f} "
                    f"| {ref['import'] / 1e9:.2f} | {extra['import'] / 1e9:+.2f} "
                    f"| {got['step'] / 1e9:.2f} | {ref['step'] / 1e9:.2f} "
                    f"| {extra['step'] / 1e9:+.2f} |"
                )
                verdicts.append(
                    f"- {label}, {name}: reading the checkpoint instead of drawing random "
                    f"weights adds {extra['import'] / 1e9:+.2f} GB "
                    f"({extra['import'] / model_bytes:+.2f}x the model) to the peak once the "
                    f"Engine is built and {extra['step'] / 1e9:+.2f} GB "
                    f"({extra['step'] / model_bytes:+.2f}x) to the whole step's"
                )
            for f in folder.iterdir():
                f.unlink()
    lines += ["", "Acceptance:", "", *verdicts]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
