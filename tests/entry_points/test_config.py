"""YAML + key=value configuration: presets load, typos and bad values are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import ConfigError, load_config, preset_path, valid_keys, validate_layout
from models.gpt import count_parameters, pad_vocab_size

PRESETS = {  # name: (layers, hidden, heads)
    "tiny": None,
    "gpt2-124m": (12, 768, 12),
    "gpt2-355m": (24, 1024, 16),
    "gpt2-774m": (36, 1280, 20),
    "gpt2-1.5b": (48, 1600, 25),
    "megatron-8.3b": (72, 3072, 32),
    "turing-nlg-17b": (78, 4256, 28),
}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name: str) -> None:
    config = load_config(preset_path(name))
    shape = PRESETS[name]
    if shape is not None:
        m = config.model
        assert (m.n_layer, m.d_model, m.n_head) == shape
    assert config.run_dir == f"runs/{name}"


def test_preset_sizes_are_the_published_ones() -> None:
    def billions(name: str) -> float:
        model = load_config(preset_path(name)).model
        model.vocab_size = pad_vocab_size(50257)
        return count_parameters(model) / 1e9

    assert billions("gpt2-1.5b") == pytest.approx(1.56, abs=0.01)
    assert billions("megatron-8.3b") == pytest.approx(8.3, abs=0.05)
    assert billions("turing-nlg-17b") == pytest.approx(17.2, abs=0.2)
    assert load_config(preset_path("turing-nlg-17b")).model.seq_len == 1024


def test_overrides_are_typed() -> None:
    config = load_config(
        preset_path("tiny"),
        [
            "train.lr=3e-4",
            "parallel.tp=2",
            "train.steps=1e3",
            "parallel.sequence_parallel=true",
            "data.files=[a.txt, b.jsonl]",
            "tracking.wandb.mode=disabled",
            "model.vocab_size=null",
            "parallel.zero_stage=3",
            "run_dir=/tmp/x",
        ],
    )
    assert config.train.lr == 3e-4 and isinstance(config.train.lr, float)
    assert config.parallel.tp == 2 and config.train.steps == 1000
    assert config.parallel.sequence_parallel is True and config.parallel.zero_stage == 3
    assert config.data.files == ["a.txt", "b.jsonl"]
    assert config.tracking.wandb.mode == "disabled"
    assert config.model.vocab_size is None and config.run_dir == "/tmp/x"


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("train.lrr=1", "train.lr"),
        ("trian.steps=5", "train.steps"),
        ("model.n_heads=4", "model.n_head"),
        ("lr=1e-3", "train.lr"),
        ("tracking.wandb.mdoe=offline", "tracking.wandb.mode"),
    ],
)
def test_unknown_key_suggests_nearest(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown config key .*did you mean '{suggestion}'"):
        load_config(preset_path("tiny"), [override])


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  global_batch: 8\n")
    with pytest.raises(ConfigError, match="did you mean 'train.global_batch_size'"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "parallel.recompute=some",
            "parallel.recompute='some' is not allowed; choose one of none|selective|full",
        ),
        ("parallel.zero_stage=4", "parallel.zero_stage=4 is not allowed; choose one of 0|1|2|3"),
        ("train.precision=fp8", "choose one of fp32|bf16|fp16"),
        ("tracking.wandb.mode=cloud", "choose one of offline|online|disabled"),
        ("train.steps=ten", "train.steps='ten' must be an integer"),
        ("train.steps=2.5", "must be an integer"),
        ("train.lr=fast", "train.lr='fast' must be a number"),
        ("train.lr=0", "train.lr=0.0 must be positive"),
        ("train.steps=-3", "train.steps=-3 must be positive"),
        ("train.micro_batch_size=0", "train.micro_batch_size=0 must be positive"),
        ("parallel.sequence_parallel=maybe", "must be true or false"),
        ("model.dropout=1.5", "model.dropout=1.5 must be in"),
        ("model.n_head=3", "model.d_model=128 is not divisible by model.n_head=3"),
        ("train.global_batch_size=12", "not a multiple of train.micro_batch_size=8"),
        ("parallel.sequence_parallel=true", "needs parallel.tp > 1"),
        ("parallel.recompute_every=0", "parallel.recompute_every=0 must be positive"),
        ("train.min_lr=1", "exceeds train.lr"),
        ("train", "must look like key=value"),
        ("train=3", "'train' is a section"),
    ],
)
def test_bad_values_name_key_and_allowed(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(preset_path("tiny"), [override])
    assert message in str(error.value)


def test_layout_checks_against_world_size() -> None:
    config = load_config(preset_path("tiny"), ["train.global_batch_size=16"])
    assert validate_layout(config, 2) == 2
    with pytest.raises(ConfigError, match="not divisible by micro_batch_size x dp = 8 x 4"):
        validate_layout(config, 4)
    config = load_config(preset_path("tiny"), ["parallel.tp=4"])
    with pytest.raises(ConfigError, match="parallel.tp: world size 6 is not divisible by tp=4"):
        validate_layout(config, 6)
    with pytest.raises(ConfigError, match="model.n_head=4 is not divisible by parallel.tp=8"):
        load_config(preset_path("tiny"), ["parallel.tp=8"])


def test_tensor_parallel_shapes_are_checked_before_start() -> None:
    with pytest.raises(ConfigError, match="model.n_head=4 is not divisible by parallel.tp=8"):
        load_config(preset_path("tiny"), ["parallel.tp=8"])
    with pytest.raises(ConfigError, match="model.seq_len=130 is not divisible by parallel.tp=4"):
        load_config(
            preset_path("tiny"),
            ["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=130"],
        )
    config = load_config(preset_path("tiny"), ["parallel.tp=2", "parallel.sequence_parallel=1"])
    assert validate_layout(config, 4) == 2  # tp=2 x dp=2
    with pytest.raises(ConfigError, match="world size 3 is not divisible by tp=2"):
        validate_layout(config, 3)


def test_missing_config_file_lists_presets() -> None:
    with pytest.raises(ConfigError, match="not found .*tiny"):
        load_config("configs/nope.yaml")


def test_valid_keys_cover_the_contract() -> None:
    keys = set(valid_keys())
    contract = {
        "model.n_layer",
        "model.n_head",
        "model.d_model",
        "model.seq_len",
        "model.dropout",
        "model.vocab_size",
        "parallel.tp",
        "parallel.zero_stage",
        "parallel.sequence_parallel",
        "parallel.recompute",
        "train.steps",
        "train.global_batch_size",
        "train.micro_batch_size",
        "train.lr",
        "train.min_lr",
        "train.warmup_steps",
        "train.weight_decay",
        "train.grad_clip",
        "train.seed",
        "train.precision",
        "train.eval_every",
        "train.eval_batches",
        "data.files",
        "data.tokenizer",
        "tracking.wandb.mode",
        "tracking.wandb.project",
        "tracking.wandb.name",
        "run_dir",
    }
    assert contract <= keys
