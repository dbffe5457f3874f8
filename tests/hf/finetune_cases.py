"""Small Hugging Face folders and data files for the fine-tuning tests, and the worker
that runs launch.finetune's training in a process group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from small_run import TINY_CONFIG
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from launch.data.token_file import iter_documents
from launch.data.tokenizers import train_bpe_tokenizer
from launch.finetune import read_finetune_config
from launch.train.checkpointing import resume_from
from launch.train.entry import check_before_start
from launch.train.loop import train

FINETUNE_CONFIG = TINY_CONFIG.parent / "finetune.yaml"


def corpus_tokenizer(corpus: Path, cache_dir: Path) -> PreTrainedTokenizerBase:
    return train_bpe_tokenizer(
        lambda: iter_documents([corpus], "text", cache_dir), 320, f"ft-{corpus}", cache_dir
    )


def llama_folder(folder: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A random Llama (grouped-query attention: 4 query heads on 2 kv heads, untied output)
    saved with save_pretrained, plus the tokenizer: what a user downloads from the hub."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # off transformers' init, so nothing passes by symmetry
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def prompt_completion_file(corpus: Path, path: Path, n: int = 48) -> Path:
    """Records of `prompt` (a line of the play) and `completion` (the next one or two
    lines), of varied lengths, so micro-batches hold different numbers of loss tokens."""
    lines = [line for line in corpus.read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        for i in range(n):
            prompt = "\n".join(lines[3 * i : 3 * i + 1 + i % 2]) + "\n"
            completion = "\n".join(lines[3 * i + 1 + i % 2 : 3 * i + 3])
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def finetune_losses(runs: dict[str, list[str]]) -> dict[str, Any]:
    """Run each fine-tuning config in one process group; rank 0 returns each run's
    metrics.jsonl, and under "ran" the steps each run ran itself (`train`'s history)."""
    env = init_distributed()
    try:
        results: dict[str, Any] = {"ran": {}}
        for name, overrides in runs.items():
            config = read_finetune_config(str(FINETUNE_CONFIG), overrides)
            dp = check_before_start(config, world_size_from_env())
            history = train(config, env, dp, resume_from(config))
            if env.is_main:
                metrics = Path(config.run_dir) / "metrics.jsonl"
                results[name] = [json.loads(line) for line in metrics.open()]
                results["ran"][name] = [row["step"] for row in history]
        return results
    finally:
        shutdown(env)


def refused(module: Any, overrides: list[str], capsys: Any) -> str:
    """What `module.main` (launch.finetune or launch.pretrain) printed on stderr when it
    refused the fine-tuning config plus `overrides` with exit code 2."""
    code = module.main(["--config", str(FINETUNE_CONFIG), *overrides])
    assert code == 2
    return capsys.readouterr().err
