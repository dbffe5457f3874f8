"""Fine-tune a Hugging Face checkpoint (GPT-2 or Llama family) at any layout:

    torchrun --standalone --nproc_per_node N -m launch.finetune \
        --config configs/finetune.yaml init_from=<Hugging Face folder> [key=value ...]

or any AutoModelForCausalLM folder (Qwen2, Mistral, Phi-3, Gemma, ...) as it is, at tp=1
with ZeRO 0-3, with `model_source=hf` (models.hf_native).

The model's shape and weights come from the folder (config.json, model.safetensors or
pytorch_model.bin read with weights_only=True); each rank keeps only its TP and ZeRO shard.
So does the tokenizer, when the folder has one (`data.tokenizer` may name another folder).
Data are local files: text (.txt, or jsonl/parquet `text` records), packed into windows of
`train.seq_len` tokens, or jsonl records of `prompt` and `completion`, with the loss on
the completion only (launch.data.examples). Every parallel option, checkpoint and resume
key works as in launch.pretrain; at the end the model is exported to `<run_dir>/hf`, a
folder `from_pretrained` loads, with the tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path

from launch.config import Config, ConfigError, load_config
from launch.data.tokenizers import has_tokenizer
from launch.train.entry import run
from models.gpt import GPTConfig
from models.gpt.hf.folder import read_hf_config


def read_pretrained_model(folder: str, source: str = "gpt") -> GPTConfig:
    """The model config of a Hugging Face folder, checked before anything starts. With
    model_source=hf the model is not converted: only its longest sequence and vocabulary
    fill the model section (train.seq_len and the tokenizer are checked against them),
    after the model was built on meta and the folder's weights checked against it."""
    try:
        if source == "hf":
            from models.hf_native.causal_lm import HFCausalLM

            model = HFCausalLM(folder)
            longest = getattr(model.hf_config, "max_position_embeddings", None) or 2**20
            return GPTConfig(seq_len=longest, vocab_size=model.config.vocab_size)
        return read_hf_config(folder)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(f"init_from: {error}") from None


def read_finetune_config(path: str | None, overrides: list[str]) -> Config:
    config = load_config(path, overrides, pretrained_model=read_pretrained_model)
    folder = Path(config.init_from)
    if config.data.tokenizer in ("gpt2", "bpe"):
        if has_tokenizer(folder):
            config.data.tokenizer = str(folder)
        elif config.data.tokenizer == "bpe":
            raise ConfigError(
                "data.tokenizer=bpe trains a new vocabulary, which the pretrained embeddings "
                f"do not know; {folder} has no tokenizer, so set data.tokenizer to its folder"
            )
    return config


def main(argv: list[str] | None = None) -> int:
    return run(
        argv,
        "python -m launch.finetune",
        "Fine-tune a Hugging Face checkpoint (run it under torchrun).",
        read_finetune_config,
    )


if __name__ == "__main__":
    sys.exit(main())
