"""Run configuration: YAML files in `configs/` plus `key=value` overrides, into typed dataclasses.

    python -m launch.pretrain --config configs/tiny.yaml train.lr=3e-4 parallel.tp=2

Every key is checked: an unknown key is an error that suggests the nearest valid one, a
value of the wrong type or outside its allowed set names the key and what it accepts.
The sections are in `sections.py`, the checks in `validate.py`, the dotted-key tree in
`tree.py`; this module loads a file into them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from launch.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    MixtureSource,
    ParallelConfig,
    SampleConfig,
    TrackingConfig,
    TrainConfig,
    WandbConfig,
)
from launch.config.tree import ConfigError, build, set_dotted, to_dict
from launch.config.tree import valid_keys as _valid_keys
from launch.config.validate import validate, validate_layout
from models.gpt import GPTConfig

__all__ = [
    "PRESET_DIR",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "MixtureSource",
    "ParallelConfig",
    "SampleConfig",
    "TrackingConfig",
    "TrainConfig",
    "WandbConfig",
    "load_config",
    "preset_names",
    "preset_path",
    "to_dict",
    "valid_keys",
    "validate",
    "validate_layout",
]

# launch/config/__init__.py -> the repository's configs/ folder.
PRESET_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


def preset_names() -> list[str]:
    """Every preset's name: the YAML files under configs/ (grouped in folders by family)."""
    return sorted(p.stem for p in PRESET_DIR.rglob("*.yaml"))


def preset_path(name: str) -> Path:
    """The file of the preset called `name` (e.g. `gpt2-124m` -> configs/gpt2/gpt2-124m.yaml)."""
    found = sorted(PRESET_DIR.rglob(f"{name}.yaml"))
    if not found:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return found[0]


def load_config(
    path: str | Path | None,
    overrides: list[str] = (),
    pretrained_model: Callable[[str, str], GPTConfig] | None = None,
) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides; returns a checked Config.

    With `pretrained_model` (fine-tuning) the model's shape is not the user's to choose:
    it is read from the `init_from` folder by `pretrained_model(init_from, model_source)`,
    and of the model section only `dropout` may be set.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            presets = ", ".join(preset_names())
            raise ConfigError(f"config file {path} not found (presets in configs/: {presets})")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path} must hold a mapping of sections, not {type(loaded).__name__}"
            )
        tree = loaded
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. train.lr=3e-4")
        set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    if pretrained_model is not None:
        _take_pretrained_model(tree, pretrained_model)
    elif tree.get("init_from") is not None:
        raise ConfigError(
            "init_from is for fine-tuning: run `torchrun ... -m launch.finetune` "
            "(launch.pretrain starts from random weights; remove init_from)"
        )
    elif tree.get("model_source", "gpt") != "gpt":
        raise ConfigError(
            "model_source is for fine-tuning a Hugging Face folder: run `torchrun ... -m "
            "launch.finetune init_from=<folder>` (launch.pretrain trains our GPT; remove it)"
        )
    config = build(Config, tree)
    if config.run_dir is None:
        config.run_dir = str(Path("runs") / (Path(path).stem if path else "default"))
    validate(config)
    return config


FINE_TUNABLE_MODEL_KEYS = ("dropout",)


def _take_pretrained_model(tree: dict[str, Any], read: Callable[[str, str], GPTConfig]) -> None:
    folder = tree.get("init_from")
    if not folder:
        raise ConfigError(
            "init_from is not set; give the Hugging Face folder to fine-tune, "
            "e.g. init_from=path/to/model (config.json, weights and tokenizer)"
        )
    model = tree.get("model") or {}
    if not isinstance(model, dict):
        raise ConfigError("'model' is a section; give it keys, not a value")
    fixed = sorted(set(model) - set(FINE_TUNABLE_MODEL_KEYS))
    if fixed:
        raise ConfigError(
            f"model.{fixed[0]} cannot be set when fine-tuning: the model's shape comes from "
            f"{folder}/config.json (only model.dropout may be set); remove it"
        )
    source = tree.get("model_source", "gpt")
    tree["model"] = dataclasses.asdict(read(str(folder), source)) | model


def valid_keys() -> list[str]:
    """Every dotted key the config accepts, e.g. 'train.lr'."""
    return _valid_keys(Config)
