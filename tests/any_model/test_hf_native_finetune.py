"""launch.finetune with model_source=hf: a Qwen2 folder (attention biases, tied
embeddings; a family we do not convert) fine-tuned as it is at dp=2, ZeRO-3, with every
layer recomputed.

- Stopped after step 3 and resumed, the rerun runs only steps 4-6 and its losses equal
  the uninterrupted run's exactly: the model's shards, Adam's, the data position and the
  random state all came from the checkpoint.
- The exported folder (safetensors, sharded by max size) loads with transformers'
  from_pretrained, and its loss on the validation windows is the run's last val_loss.
- The planner counts the model from its modules on meta (each parameter once).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import finetune_cases
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybrid.instruments.local_processes import run_processes
from launch import finetune, plan, pretrain
from launch.data import TokenWindows, prepare_data
from launch.data.mixture import validation_sets
from launch.finetune import read_finetune_config
from launch.planning.memory_check import planned_peak

STEPS = 6


def qwen2_folder(folder: Path, tokenizer: Any, tied: bool) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tokenizer(small_corpus: Path, cache_dir: Path) -> Any:
    return finetune_cases.corpus_tokenizer(small_corpus, cache_dir)


@pytest.fixture(scope="module")
def qwen2(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen2_folder(tmp_path_factory.mktemp("qwen2"), tokenizer, tied=True)


def _overrides(folder: Path, corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    return [
        f"init_from={folder}",
        "model_source=hf",
        f"data.files=[{corpus}]",
        f"data.cache_dir={cache}",
        f"run_dir={run_dir}",
        "data.val_fraction=0.05",
        f"train.steps={STEPS}",
        "train.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.lr=3e-3",
        "train.eval_every=3",
        "train.eval_batches=1",
        "parallel.zero_stage=3",
        "parallel.recompute=full",
        "sample.tokens=4",
        "tracking.wandb.mode=disabled",
    ]


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen2_folder_fine_tunes_as_it_is_resumes_exactly_and_exports(
    tied: bool, tokenizer: Any, small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Tied, the one table is in bucket 0; untied, the embedding and the output layer are
    units of their own (models.hf_native.causal_lm.units_of), gathered around their use,
    and stages 0-2 without recomputation give stage 3's losses."""
    qwen2 = qwen2_folder(tmp_path / "model", tokenizer, tied)
    straight = _overrides(qwen2, small_corpus, cache_dir, tmp_path / "straight")
    stopped = _overrides(qwen2, small_corpus, cache_dir, tmp_path / "stopped")
    runs = {"straight": straight, "first": [*stopped, "train.stop_at=3"], "rest": stopped}
    other_stages = {  # untied: stages 0-2 without recomputation, in the same job
        f"stage {k}": [
            *_overrides(qwen2, small_corpus, cache_dir, tmp_path / f"stage{k}"),
            f"parallel.zero_stage={k}",
            "parallel.recompute=none",
            "sample.tokens=0",
        ]
        for k in ((0, 1, 2) if not tied else ())
    }
    results = run_processes(finetune_cases.finetune_losses, 2, runs | other_stages)[0]
    ran = {name: results["ran"][name] for name in runs}
    assert ran == {"straight": [1, 2, 3, 4, 5, 6], "first": [1, 2, 3], "rest": [4, 5, 6]}
    losses = [m["loss"] for m in results["straight"]]
    assert [m["loss"] for m in results["rest"]] == losses  # metrics.jsonl: steps 1-3, 4-6
    assert losses[-1] < losses[0] - 0.1, losses  # it learns: the comparison means something
    for name in other_stages:  # the same losses as stage 3 with recomputation
        got = [m["loss"] for m in results[name]]
        assert got == pytest.approx(losses, rel=1e-5), (name, got, losses)

    # The export loads in transformers; its loss on the run's validation windows is the
    # run's own last val_loss (the same logits, within fp32 rounding).
    exported = tmp_path / "straight" / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied  # as saved
    config = read_finetune_config(str(finetune_cases.FINETUNE_CONFIG), straight)
    val = TokenWindows(prepare_data(config.data).val_tokens, 32)
    batches = validation_sets(val, 4, 2, 0, 1)[0][2]  # every rank's windows, in one process
    total, count = 0.0, 0
    with torch.no_grad():
        for window in batches:
            window = torch.as_tensor(window).long()
            logits = model(window[:, :-1]).logits
            targets = window[:, 1:].flatten()
            total += F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum").item()
            count += targets.numel()
    assert (exported / "tokenizer.json").is_file() or (exported / "vocab.json").is_file()
    assert results["straight"][-1]["val_loss"] == pytest.approx(total / count, rel=1e-5)

    # The planner's model states come from the modules on meta: every parameter once.
    plan = planned_peak(config, config.model, 2)
    assert plan.total_parameters == sum(p.numel() for p in model.parameters())


def test_what_cannot_train_as_it_is_is_refused_before_start(
    qwen2: Path, small_corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """One line naming the key and the fix, exit code 2, before any process group."""
    base = _overrides(qwen2, small_corpus, cache_dir, tmp_path / "bad")
    assert "parallel.tp=2 needs our layers" in finetune_cases.refused(
        finetune, [*base, "parallel.tp=2"], capsys
    )
    err = finetune_cases.refused(finetune, [*base, "parallel.recompute=selective"], capsys)
    assert "recompute=full" in err
    err = finetune_cases.refused(pretrain, ["model_source=hf"], capsys)
    assert "model_source is for fine-tuning" in err
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((qwen2 / "config.json").read_text())
    err = finetune_cases.refused(finetune, [*base, f"init_from={no_weights}"], capsys)
    assert "no weights" in err and str(no_weights) in err


def test_launch_plan_counts_a_folder_from_its_config_alone(qwen2: Path, capsys) -> None:
    """`launch.plan --hf`: the model on meta from config.json (weights not read)."""
    assert plan.main(["--hf", str(qwen2), "--gpus", "2", "--zero-stage", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = Qwen2ForCausalLM.from_pretrained(str(qwen2))
    assert out["total_parameters"] == sum(p.numel() for p in model.parameters())
