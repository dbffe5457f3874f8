"""`python -m launch.convert`: a Hugging Face folder -> our checkpoint -> a Hugging Face
folder that `from_pretrained` loads with the same logits; and a pretraining run exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hf_cases import make_hf, tokens
from safetensors.torch import load_file
from small_run import TINY_CONFIG, small_run_overrides
from transformers import AutoModelForCausalLM

from hybrid.distributed import init_distributed, shutdown, world_size_from_env
from hybrid.testing import run_processes
from launch import convert
from launch.config import load_config, validate_layout
from launch.training import train
from models.gpt import GPT, GPTConfig


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_import_then_export_round_trip(family: str, tmp_path: Path) -> None:
    original = make_hf(family, seed=4)
    original.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert.main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    checkpoint = tmp_path / "ck" / "step_00000000"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 0 and state["config"]["model"]["n_layer"] == 3
    out = tmp_path / "exported"
    assert convert.main(["--to-hf", str(out), "--checkpoint", str(checkpoint)]) == 0
    back = AutoModelForCausalLM.from_pretrained(out)
    ids = tokens()
    with torch.no_grad():
        expected, got = original(ids).logits, back(ids).logits
    assert type(back) is type(original)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)


def test_convert_refuses_a_folder_that_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert convert.main(["--to-hf", str(tmp_path / "o"), "--checkpoint", str(tmp_path)]) == 2
    assert "is not a complete checkpoint" in capsys.readouterr().err


def test_convert_from_gguf_names_a_missing_file_or_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = "no-such-package-or-file.gguf"
    assert convert.main(["--from-gguf", missing, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--from-gguf {missing}: neither a file nor an installed package" in err
    assert not (tmp_path / "o").exists()


def _pretrain(overrides: list[str]) -> None:
    env = init_distributed()
    try:
        config = load_config(TINY_CONFIG, overrides)
        train(config, env, validate_layout(config, world_size_from_env()))
    finally:
        shutdown(env)


def test_a_tp2_pretraining_run_exports_to_transformers(
    small_corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Pretrained at tp=2 x dp=1 for 3 steps, exported from its checkpoint in one process:
    GPT2LMHeadModel.from_pretrained gives the logits of the run's final weights (1e-5)."""
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(small_corpus, cache_dir, run_dir)
    overrides += ["parallel.tp=2", "train.steps=3", "sample.tokens=0"]
    run_processes(_pretrain, 2, overrides)
    out = tmp_path / "exported"
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert convert.main(["--to-hf", str(out), "--checkpoint", str(checkpoint)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (out / "tokenizer.json").is_file()

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    ours = GPT(GPTConfig(**saved), init_weights=load_file(run_dir / "model.safetensors")).eval()
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(ids), hf(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
