"""launch.finetune: a Hugging Face Llama folder (grouped-query attention, untied output)
fine-tuned on prompt/completion records and on plain text, at several layouts.

- The loss is the mean over completion tokens of the whole global batch: step 1's loss
  equals transformers' cross-entropy with the prompt and padding labels ignored, and the
  per-step losses at (tp=2, dp=2, stage 3) and (dp=4, stage 1) equal one process's
  within 1e-5 relative (fp32, dropout 0), and one process takes the global batch as one
  micro-batch of 8 while the ranks take micro-batches of 2 holding different numbers of
  loss tokens.
- The exported folder loads with from_pretrained, and its loss on the validation records
  is the run's last val_loss.
- A stopped and resumed fine-tuning run has the same losses as a straight one.
- Bad input: a malformed jsonl line, a missing or unsupported folder, a model key.
"""

from __future__ import annotations

import json
from pathlib import Path

import finetune_cases
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from hybrid.instruments.local_processes import run_processes
from launch import finetune, pretrain
from launch.data.examples import read_examples
from launch.data.sampler import DistributedBatches
from launch.data.tokenizers import load_tokenizer_folder

STEPS = 6


@pytest.fixture(scope="module")
def llama(small_corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = finetune_cases.corpus_tokenizer(small_corpus, cache_dir)
    return finetune_cases.llama_folder(tmp_path_factory.mktemp("llama"), tokenizer)


@pytest.fixture(scope="module")
def records(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "records.jsonl"
    return finetune_cases.prompt_completion_file(small_corpus, path)


def _overrides(llama: Path, files: Path, cache: Path, run_dir: Path) -> list[str]:
    return [
        f"init_from={llama}",
        f"data.files=[{files}]",
        f"data.cache_dir={cache}",
        f"run_dir={run_dir}",
        "data.val_fraction=0.125",  # 6 of 48 records
        f"train.steps={STEPS}",
        "train.seq_len=48",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.lr=3e-3",
        "train.eval_every=3",
        "train.eval_batches=1",
        "sample.tokens=0",
        "tracking.wandb.mode=disabled",
    ]


def test_prompt_completion_loss_is_layout_free_and_matches_transformers(
    llama: Path, records: Path, cache_dir: Path, tmp_path: Path
) -> None:
    # One micro-batch of 8 in one process against micro-batches of 2 on 4 ranks: a loss
    # averaged per micro-batch would differ (the numbers of completion tokens differ).
    base = _overrides(llama, records, cache_dir, tmp_path / "single")
    single = finetune_cases.finetune_losses({"single": [*base, "train.micro_batch_size=8"]})
    single = single["single"]
    runs = {
        "tp2-dp2-zero3": ["parallel.tp=2", "parallel.zero_stage=3"],
        "dp4-zero1": ["parallel.zero_stage=1"],
    }
    parallel = run_processes(
        finetune_cases.finetune_losses,
        4,
        {k: _overrides(llama, records, cache_dir, tmp_path / k) + v for k, v in runs.items()},
    )[0]
    reference = [m["loss"] for m in single]
    assert reference[-1] < reference[0] - 0.3  # it learns, so the comparison means something
    for name in runs:
        assert [m["loss"] for m in parallel[name]] == pytest.approx(reference, rel=1e-5), name

    # Step 1's loss from transformers on the same global batch, prompts and padding ignored.
    tokenizer = load_tokenizer_folder(llama)
    examples = read_examples([records], tokenizer, 48)
    train_set, val_set = examples.split(0.125)
    first = DistributedBatches(train_set, 1234, 8, 8, 0, 1).next_step()[0]
    hf = LlamaForCausalLM.from_pretrained(str(llama)).eval()
    assert reference[0] == pytest.approx(_hf_loss(hf, *first), rel=1e-5)
    masked = (first[1] == -100).float().mean().item()
    assert 0.2 < masked < 0.9  # prompts and padding really are left out

    # The exported model's loss on every validation record is the run's last val_loss.
    exported = LlamaForCausalLM.from_pretrained(str(tmp_path / "single" / "hf")).eval()
    val_loss = _hf_loss(exported, *val_set.batch(range(len(val_set))))
    assert single[-1]["val_loss"] == pytest.approx(val_loss, rel=1e-5)
    assert (tmp_path / "single" / "hf" / "tokenizer.json").is_file()


def _hf_loss(model: LlamaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).item()


def test_text_finetuning_resumes_exactly(
    llama: Path, small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Packed text at dp=2, stage 2, dropout 0.1: stopped after step 3 and resumed at step
    4 (not from the start: the rerun's own steps are 4-6), the losses equal a straight
    run's exactly, so the weights, the optimizer, the data position and the random state
    all came from the checkpoint."""
    text = ["parallel.zero_stage=2", "train.global_batch_size=4", "data.val_fraction=0.05"]
    text += ["model.dropout=0.1"]
    straight = _overrides(llama, small_corpus, cache_dir, tmp_path / "straight") + text
    stopped = _overrides(llama, small_corpus, cache_dir, tmp_path / "stopped") + text
    runs = {"straight": straight, "first": [*stopped, "train.stop_at=3"], "rest": stopped}
    results = run_processes(finetune_cases.finetune_losses, 2, runs)[0]
    ran = {"straight": [1, 2, 3, 4, 5, 6], "first": [1, 2, 3], "rest": [4, 5, 6]}
    assert results["ran"] == ran
    losses = [m["loss"] for m in results["straight"]]
    assert [m["loss"] for m in results["rest"]] == losses  # metrics.jsonl: steps 1-3, 4-6
    vals = [m["val_loss"] for m in results["straight"] if "val_loss" in m]
    assert vals[-1] < vals[0]


def test_bad_finetune_input_is_refused_clearly(
    llama: Path, records: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = _overrides(llama, records, cache_dir, tmp_path / "bad")
    broken = tmp_path / "broken.jsonl"
    lines = records.read_text().splitlines()
    broken.write_text("\n".join([*lines[:4], '{"prompt": "x", "completion": 3}', *lines[4:]]))
    err = finetune_cases.refused(finetune, [*base, f"data.files=[{broken}]"], capsys)
    assert f"{broken}:5: 'completion' must be a string" in err

    broken.write_text("\n".join([*lines[:2], '{"prompt": "x", ', *lines[2:]]))
    assert f"{broken}:3: not valid JSON" in finetune_cases.refused(
        finetune, [*base, f"data.files=[{broken}]"], capsys
    )

    missing = tmp_path / "nowhere"
    err = finetune_cases.refused(finetune, [*base, f"init_from={missing}"], capsys)
    assert f"init_from: {missing}: not a folder" in err

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"")
    assert "model_type 'bert' is not supported" in finetune_cases.refused(
        finetune, [*base, f"init_from={bert}"], capsys
    )

    err = finetune_cases.refused(finetune, [*base, "model.n_layer=4"], capsys)
    assert "model.n_layer cannot be set when fine-tuning" in err
    err = finetune_cases.refused(pretrain, [f"init_from={llama}"], capsys)
    assert "init_from is for fine-tuning" in err
