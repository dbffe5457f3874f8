"""`python -m launch.convert`: a Hugging Face folder -> our checkpoint -> a Hugging Face
folder that `from_pretrained` loads with the same logits; and a pretraining run exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_cases import make_hf, tokens
from transformers import AutoModelForCausalLM

from launch import convert


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
