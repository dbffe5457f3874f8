"""`python -m launch.convert`: a Hugging Face folder -> our checkpoint -> a Hugging Face
folder that `from_pretrained` loads with the same logits; and a pretraining run exported."""

from __future__ import annotations

import contextlib
import json
import math
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import convert_cases
import pytest
import torch
import yaml
from hf_cases import make_hf, random_hf, tokens
from safetensors.torch import load_file
from small_run import TINY_CONFIG, small_run_overrides
from torch.distributed.checkpoint.filesystem import FileSystem
from transformers import (
    AutoModelForCausalLM,
)

from hybrid.checkpoint import offline_write as checkpoint_write
from hybrid.checkpoint.folders import SafeReader
from hybrid.checkpoint.offline_read import CheckpointTensors, checkpoint_tensor_layout
from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from hybrid.instruments.local_processes import run_processes
from launch import convert
from launch.config import load_config, validate_layout
from launch.train.loop import train
from models.gpt import GPT, GPTConfig
from models.gpt.hf.folder import read_hf_folder


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


# -- streamed conversion: no Engine in the converter, any layout in between ---------------


def _hf_model(family: str) -> torch.nn.Module:
    """Sizes no other test uses: vocabulary 999 (not divisible by tp=2), d_ff an odd
    multiple (GPT-2: 3 x d_model; Llama: 7 x 8), 4 heads on 2 kv heads for Llama."""
    gpt2 = dict(vocab_size=999, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=96)
    llama = dict(
        vocab_size=999, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    return random_hf(family, 21, gpt2 if family == "gpt2" else llama)


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out


def test_hf_to_ours_at_tp2_stage3_and_back_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acceptance: HF (sharded) -> --from-hf -> loaded and saved again at tp=2 stage 3 by
    a 2-process job -> --to-hf (sharded): every tensor identical to the original's. The
    export reads, at DCP's file streams, only bytes of `model.*` items, never a moment's.
    The import writes 4 KB chunks (the embedding in 32), which the tp=2 ranks reshard."""
    monkeypatch.setattr(checkpoint_write, "CHUNK_BYTES", 4096)
    originals, jobs = {}, {}
    for family in ("gpt2", "llama"):
        originals[family] = _hf_model(family)
        originals[family].save_pretrained(tmp_path / family, max_shard_size="60KB")
        root = tmp_path / f"ck-{family}"
        args = ["--from-hf", str(tmp_path / family), "--out", str(root), "--optimizer-states"]
        assert convert.main(args) == 0
        layout = checkpoint_tensor_layout(root / "step_00000000")
        assert {k.split(".")[0] for k in layout} == {"model", "exp_avg", "exp_avg_sq"}
        index = SafeReader(str(root / "step_00000000")).read_metadata().state_dict_metadata
        assert len(index["model.wte.weight"].chunks) == 32  # 999 rows of 128 bytes
        jobs[family] = (str(root / "step_00000000"), str(tmp_path / f"resharded-{family}"))
    run_processes(convert_cases.reshard, 2, jobs)
    for family, original in originals.items():
        out = tmp_path / f"back-{family}"
        checkpoint = Path(jobs[family][1]) / "step_00000001"
        args = ["--to-hf", str(out), "--checkpoint", str(checkpoint), "--max-shard-size", "60KB"]
        with _recorded_reads(monkeypatch) as reads:
            assert convert.main(args) == 0
        _assert_reads_only_weights(checkpoint, reads)
        assert (out / "model.safetensors.index.json").is_file()
        expected = original.state_dict()
        if original.config.tie_word_embeddings:
            del expected["lm_head.weight"]  # save_pretrained leaves the tied copy out
        got = _exported(out)
        assert got.keys() == expected.keys(), family
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), f"{family} {name}"
        assert type(AutoModelForCausalLM.from_pretrained(out)) is type(original)


class _RecordingStream:
    """A file opened by DCP's reader, recording the byte ranges read from it."""

    def __init__(self, stream: Any, reads: list[tuple[int, int]]) -> None:
        self.stream, self.reads = stream, reads

    def read(self, size: int = -1) -> bytes:
        start = self.stream.tell()
        data = self.stream.read(size)
        self.reads.append((start, start + len(data)))
        return data

    def readinto(self, buffer: Any) -> int:
        start = self.stream.tell()
        n = self.stream.readinto(buffer)
        self.reads.append((start, start + n))
        return n

    def __getattr__(self, name: str) -> Any:  # seek, tell, seekable, readable, ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def _recorded_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list]]:
    """file name -> the (start, end) byte ranges DCP's readers read from it."""
    reads: dict[str, list[tuple[int, int]]] = {}
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            if "r" not in mode:
                yield stream
            else:
                yield _RecordingStream(stream, reads.setdefault(Path(path).name, []))

    with monkeypatch.context() as patch:
        patch.setattr(FileSystem, "create_stream", create_stream)
        yield reads


def _assert_reads_only_weights(checkpoint: Path, reads: dict[str, list]) -> None:
    """Every byte read lies in a `model.*` item of the index; every one of those is read;
    not one byte of an Adam moment is."""
    storage = SafeReader(str(checkpoint)).read_metadata().storage_data
    items = [(i.fqn, s.relative_path, s.offset, s.offset + s.length) for i, s in storage.items()]
    assert {fqn.split(".")[0] for fqn, *_ in items} == {"model", "exp_avg", "exp_avg_sq"}
    for file, ranges in reads.items():
        for start, end in ranges:
            if end == start:
                continue
            inside = [fqn for fqn, f, lo, hi in items if f == file and lo <= start and end <= hi]
            assert inside and inside[0].startswith("model."), (file, start, end, inside)
    for fqn, file, lo, hi in items:
        if fqn.startswith("model."):
            assert any(lo <= s and e <= hi and e > s for s, e in reads.get(file, [])), fqn


def test_to_hf_names_a_bad_checkpoint_or_shard_size_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _hf_model("gpt2").save_pretrained(tmp_path / "hf")
    assert convert.main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    checkpoint = tmp_path / "ck" / "step_00000000"
    capsys.readouterr()
    out = tmp_path / "out"
    cases = [
        (["--checkpoint", str(tmp_path / "nowhere")], "nowhere does not exist"),
        (["--checkpoint", str(checkpoint), "--max-shard-size", "5 gigs"], "'5 gigs' cannot be"),
    ]
    for extra, message in cases:
        assert convert.main(["--to-hf", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    (checkpoint / "__0_0.distcp").unlink()  # an incomplete checkpoint
    assert convert.main(["--to-hf", str(out), "--checkpoint", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "__0_0.distcp is missing" in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_a_checkpoint_without_moments_resumes_at_tp2_dp2_stage3(tmp_path: Path) -> None:
    """--from-hf writes no moments by default; a tp=2 x dp=2 stage-3 job loads it with a
    warning, its moments zero and its weights the model's, and trains a step."""
    original = _hf_model("llama")
    original.save_pretrained(tmp_path / "hf")
    assert convert.main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    checkpoint = tmp_path / "ck" / "step_00000000"
    assert {k.split(".")[0] for k in checkpoint_tensor_layout(checkpoint)} == {"model"}
    _, weights = read_hf_folder(tmp_path / "hf")
    for result in run_processes(convert_cases.resume_without_moments, 4, str(checkpoint)):
        assert re.search(r"moment|optimizer state", result["messages"], re.IGNORECASE)
        for name, tensor in weights.items():
            assert torch.equal(result["loaded"][f"model.{name}"], tensor), name
            assert not result["loaded"][f"exp_avg.{name}"].any(), name
            assert not result["loaded"][f"exp_avg_sq.{name}"].any(), name
        assert math.isfinite(result["loss"])
        assert result["trained"]["exp_avg_sq.wte.weight"].any()


def test_the_checkpoint_writer_holds_one_piece_at_a_time(tmp_path: Path) -> None:
    """When a piece is asked for, the memory of every piece handed out before has been
    freed (each is a numpy array's, which lives while any tensor on it does: weak
    references to the arrays are dead); the pieces read back as the tensors."""
    full = {
        "model.a": torch.randn(37, 5),
        "model.b": torch.randn(11),
        "exp_avg.a": torch.ones(37, 5),
    }
    layout = [(key, tuple(t.shape), t.dtype) for key, t in full.items()]
    handed: list[weakref.ref] = []

    def produce(key: str, start: int, end: int) -> torch.Tensor:
        assert all(ref() is None for ref in handed), "a piece is still held"
        memory = full[key][start:end].numpy().copy()
        handed.append(weakref.ref(memory))
        return torch.from_numpy(memory)

    order = checkpoint_write.write_checkpoint_tensors(tmp_path, layout, produce, 16 * 5 * 4)
    rows = [0, 16, 32]  # 16 rows of 20 bytes a chunk
    expected = [*(("model.a", r) for r in rows), ("model.b", 0), *(("exp_avg.a", r) for r in rows)]
    assert order == expected
    assert all(ref() is None for ref in handed)
    back = CheckpointTensors(tmp_path).read(full)
    assert all(torch.equal(back[key], tensor) for key, tensor in full.items())
