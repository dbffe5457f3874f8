"""The invalid-configuration matrix: each config that cannot work is refused by
`python -m launch.pretrain` (or launch.finetune) before any process group exists, with one
line on stderr that names the key and the fix, and exit code 2, without a traceback.

Process-group creation is replaced by a function that fails the test, so a case that got
past the checks cannot pass by failing later.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from small_run import TINY_CONFIG

import launch.train.entry
from launch import finetune, pretrain
from launch.data.tokenizers import GPT2_DIR

# (name, world size, overrides, what the one error line must contain)
CASES = [
    ("tp does not divide the world", 4, ["parallel.tp=3"], "parallel.tp"),
    ("heads not divisible by tp", 4, ["parallel.tp=4", "model.n_head=6", "model.d_model=96"],
     "model.n_head=6 is not divisible by parallel.tp=4"),
    ("d_model not divisible by heads", 1, ["model.d_model=100", "model.n_head=3"],
     "model.d_model=100 is not divisible by model.n_head=3"),
    ("sequence above the position table", 1, ["train.seq_len=256"],
     "train.seq_len=256 must be between 1 and model.seq_len=128"),
    ("global batch not a multiple of micro", 1, ["train.global_batch_size=12"],
     "train.global_batch_size=12 is not a multiple of train.micro_batch_size=8"),
    ("global batch not divisible by micro x dp", 4, ["train.global_batch_size=16"],
     "not divisible by micro_batch_size x dp = 8 x 4"),
    ("zero stage outside 0-3", 1, ["parallel.zero_stage=4"], "parallel.zero_stage=4"),
    ("sequence parallelism at tp=1", 2, ["parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=true needs parallel.tp > 1"),
    ("fp16 without CUDA", 1, ["train.precision=fp16"], "train.precision=fp16 needs a CUDA"),
    ("a typo in a key", 1, ["train.lrr=1e-3"], "did you mean 'train.lr'?"),
    ("a key without its section", 1, ["lr=1e-3"], "did you mean 'train.lr'?"),
    ("negative learning rate", 1, ["train.lr=-1e-3"], "train.lr=-0.001 must be positive"),
    ("zero steps", 1, ["train.steps=0"], "train.steps=0 must be positive"),
    ("zero global batch", 1, ["train.global_batch_size=0"], "train.global_batch_size=0"),
    ("negative micro batch", 1, ["train.micro_batch_size=-2"], "train.micro_batch_size=-2"),
    ("a number that is not one", 1, ["train.lr=fast"], "train.lr='fast' must be a number"),
    ("missing data file", 1, ["data.files=[{tmp}/nope.txt]"], "nope.txt does not exist"),
    ("empty corpus", 1, ["data.files=[{tmp}/empty.txt]"], "empty.txt is empty"),
    ("unknown data format", 1, ["data.files=[{tmp}/table.csv]"], "cannot tell the format"),
    ("tokenizer larger than the model's vocabulary", 1,
     [f"data.tokenizer={GPT2_DIR}", "model.vocab_size=1024"],
     "model.vocab_size=1024 is smaller than the tokenizer's 50257 tokens"),
    ("gpt2 tokenizer larger than the vocabulary", 1,
     ["data.tokenizer=gpt2", "model.vocab_size=50000"], "model.vocab_size=50000 is smaller"),
    ("not a checkpoint", 1, ["checkpoint.resume={tmp}"], "is not a complete checkpoint"),
    ("dropout of 1", 1, ["model.dropout=1.0"], "model.dropout=1.0 must be in [0, 1)"),
    ("min_lr above lr", 1, ["train.min_lr=1"], "train.min_lr=1.0 exceeds train.lr"),
    ("validation fraction of 1", 1, ["data.val_fraction=1"], "data.val_fraction=1.0"),
    ("unknown norm", 1, ["model.norm=batchnorm"], "model.norm='batchnorm' is not allowed"),
    ("kv heads not dividing heads", 1, ["model.n_kv_head=3"],
     "n_head=4 is not divisible by n_kv_head=3"),
    ("stop_at beyond steps", 1, ["train.stop_at=5000"], "train.stop_at=5000 must be between"),
    ("zero collective timeout", 1, ["dist_timeout_s=0"], "dist_timeout_s=0.0 must be positive"),
    ("zero peak TFLOP/s", 1, ["train.peak_tflops=0"], "train.peak_tflops=0.0 must be positive"),
    ("pretraining from a checkpoint folder", 1, ["init_from={tmp}"],
     "init_from is for fine-tuning"),
    ("a layout planned above the memory limit", 2, ["train.memory_limit=30MiB"],
     "exceeds train.memory_limit=30MiB (30.0 MiB)"),
    ("a memory limit without a unit", 1, ["train.memory_limit=8"],
     "train.memory_limit '8' has no unit; write 8GiB"),
    ("a zero memory limit", 1, ["train.memory_limit=0GiB"],
     "train.memory_limit=0GiB must be positive"),
    ("an unknown memory check", 1, ["train.memory_check=maybe"],
     "train.memory_check='maybe' is not allowed; choose one of stop|warn"),
]  # fmt: skip


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process group was started for an invalid config")

    monkeypatch.setattr(launch.train.entry, "init_distributed", refuse)


def _files(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")


@pytest.mark.parametrize(
    ("name", "world", "overrides", "message"), CASES, ids=[c[0] for c in CASES]
)
def test_invalid_config_is_refused_before_start(
    name: str,
    world: int,
    overrides: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_process_group: None,
) -> None:
    _files(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.chdir(tmp_path)  # a run folder, if one were made, lands here
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    code = pretrain.main(["--config", str(TINY_CONFIG), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert not (tmp_path / "runs").exists()


FINETUNE_CASES = [
    ("no init_from", [], "init_from is not set"),
    ("init_from not a folder", ["init_from={tmp}/nowhere"], "init_from: "),
    ("a model key while fine-tuning", ["init_from={tmp}", "model.n_layer=2"],
     "model.n_layer cannot be set when fine-tuning"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "overrides", "message"), FINETUNE_CASES, ids=lambda c: c)
def test_invalid_finetune_config_is_refused_before_start(
    name: str,
    overrides: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_process_group: None,
) -> None:
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    code = finetune.main(["--config", str(TINY_CONFIG.parent / "finetune.yaml"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
