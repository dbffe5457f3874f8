"""Run configuration: YAML files in `configs/` plus `key=value` overrides, into typed dataclasses.

    python -m launch.pretrain --config configs/tiny.yaml train.lr=3e-4 parallel.tp=2

Every key is checked: an unknown key is an error that suggests the nearest valid one, a
value of the wrong type or outside its allowed set names the key and what it accepts.
The section and key names are the user-facing contract; rename nothing without a shim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hybrid.distributed.topology import check_layout
from hybrid.memory.units import parse_bytes
from launch.config.tree import ConfigError as ConfigError
from launch.config.tree import build, set_dotted
from launch.config.tree import to_dict as to_dict
from launch.config.tree import valid_keys as _valid_keys
from models.gpt import GPTConfig
from models.gpt.model import check_tp_shapes

PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree; dp = world size / tp
    zero_stage: Literal[0, 1, 2, 3] = 0
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_every: int = 1  # with recompute=full: only every k-th layer (0, k, 2k, ...)
    # Stages 1-2: each bucket's parameter all-gather after the step is waited for in the
    # next forward, just before its first unit (Megatron's overlap-param-gather); false
    # waits for them all in the step. The same values either way.
    overlap_param_gather: bool = True


@dataclass
class TrainConfig:
    steps: int = 1000
    seq_len: int | None = None  # tokens per training sequence; null: model.seq_len
    global_batch_size: int = 32  # sequences per optimizer step, over all DP ranks
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    lr: float = 6e-4
    min_lr: float = 6e-5  # the cosine schedule ends here at `steps`
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # bf16/fp16: the dtype gradients are accumulated over micro-batches and reduced over DP
    # in. fp32 as Megatron and DeepSpeed default to; bf16 halves the traffic and rounds
    # every micro-batch sum and ring step to 8 bits of mantissa.
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # The device's peak TFLOP/s for MFU (null: a known GPU's bf16 peak; none on CPU).
    peak_tflops: float | None = None
    eval_every: int = 100
    eval_batches: int = 4  # validation set size, in global batches
    # Stop after this step, saving a checkpoint, as a preempted job would; the learning-rate
    # schedule still runs to `steps`, so resuming continues the same run.
    stop_at: int | None = None
    # A NaN or inf loss or gradient: skip that update on every rank with a warning, or stop
    # the job (exit code 3) without updating or saving.
    on_nonfinite: Literal["skip", "stop"] = "skip"
    # The memory of one rank's device, e.g. 8GiB. Before start-up the planner's peak for the
    # run's layout is compared with it (launch.planning.memory_check); null: the GPU's size on CUDA,
    # no check on CPU.
    memory_limit: str | None = None
    # A layout planned above the limit: stop before start-up (exit code 2), or warn and run.
    memory_check: Literal["stop", "warn"] = "stop"


@dataclass
class MixtureSource:
    """One corpus of a mixture: its files (as data.files) and its share of the windows."""

    files: list[str] = field(default_factory=list)
    weight: float = 1.0


@dataclass
class DataConfig:
    files: list[str] = field(default_factory=list)  # .txt/.jsonl/.parquet; [] = bundled corpus
    # Several corpora, windows drawn from each by weight: [{files: [...], weight: 0.7}, ...]
    # (replaces `files`; each source has its own token cache and its own val_loss).
    mixture: list[MixtureSource] = field(default_factory=list)
    verify: Literal["sample", "full"] = "sample"  # token cache check at start: sampled | all
    workers: int = 0  # tokenizing processes of the preparation; 0: one per core
    pack: bool = False  # prompt/completion examples packed several to a sequence
    text_field: str = "text"  # the column read from jsonl and parquet files
    tokenizer: str = "gpt2"  # gpt2 | bpe (trained on the corpus) | a Hugging Face tokenizer folder
    bpe_vocab_size: int = 2048  # vocabulary of the `bpe` tokenizer
    val_fraction: float = 0.05  # share of the tokens held out for validation
    cache_dir: str = "~/.cache/hybrid"  # token files and trained tokenizers


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "hybrid"
    name: str | None = None  # default: the run folder's name
    entity: str | None = None
    init_timeout_s: float = 60.0  # an unreachable server costs this much, then a warning


@dataclass
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class SampleConfig:
    """The text generated at the end of a run, to see what the model learned."""

    prompt: str = "\n"
    tokens: int = 100  # 0 disables
    temperature: float = 0.8
    top_k: int = 40


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps; 0: only at the end (and at stop_at)
    keep: int = 3  # complete checkpoints kept; older ones are deleted
    resume: str = "auto"  # auto: the latest in `dir` if any | none | a checkpoint folder
    dir: str | None = None  # default: <run_dir>/checkpoints
    # What resume checks before anything loads: full: sizes, then the checksum of every
    # file, each hashed by one rank | size: sizes only | none: .metadata and state only.
    verify: Literal["full", "size", "none"] = "full"
    # Write checkpoints in the background (key `checkpoint.async`, a Python keyword).
    async_save: bool = field(default=False, metadata={"key": "async"})


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_dir: str | None = None  # default: runs/<config file name>
    init_from: str | None = None  # launch.finetune: the Hugging Face folder to start from
    dist_timeout_s: float = 600.0  # collective timeout before a stuck job is torn down


def load_config(
    path: str | Path | None,
    overrides: list[str] = (),
    pretrained_model: Callable[[str], GPTConfig] | None = None,
) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides; returns a checked Config.

    With `pretrained_model` (fine-tuning) the model's shape is not the user's to choose:
    it is read from the `init_from` folder by `pretrained_model(init_from)`, and of the
    model section only `dropout` may be set.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
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
    config = build(Config, tree)
    if config.run_dir is None:
        config.run_dir = str(Path("runs") / (Path(path).stem if path else "default"))
    validate(config)
    return config


FINE_TUNABLE_MODEL_KEYS = ("dropout",)


def _take_pretrained_model(tree: dict[str, Any], read: Callable[[str], GPTConfig]) -> None:
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
    tree["model"] = dataclasses.asdict(read(str(folder))) | model


def validate(config: Config) -> None:
    """Checks that need no knowledge of the job's size. See `validate_layout` for those."""
    m, t, p, d, s = config.model, config.train, config.parallel, config.data, config.sample
    positive = {
        "model.n_layer": m.n_layer,
        "model.n_head": m.n_head,
        "model.d_model": m.d_model,
        "model.seq_len": m.seq_len,
        "parallel.tp": p.tp,
        "parallel.recompute_every": p.recompute_every,
        "train.steps": t.steps,
        "train.global_batch_size": t.global_batch_size,
        "train.micro_batch_size": t.micro_batch_size,
        "train.lr": t.lr,
        "train.eval_every": t.eval_every,
        "train.eval_batches": t.eval_batches,
        "data.bpe_vocab_size": d.bpe_vocab_size,
        "sample.temperature": s.temperature,
        "sample.top_k": s.top_k,
        "dist_timeout_s": config.dist_timeout_s,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        raise ConfigError(
            f"train.peak_tflops={t.peak_tflops} must be positive (or null: a known GPU's peak)"
        )
    non_negative = {
        "train.min_lr": t.min_lr,
        "train.warmup_steps": t.warmup_steps,
        "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip,
        "sample.tokens": s.tokens,
        "checkpoint.every": config.checkpoint.every,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be zero or positive")
    if config.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep} must be at least 1")
    if t.stop_at is not None and not 1 <= t.stop_at <= t.steps:
        raise ConfigError(
            f"train.stop_at={t.stop_at} must be between 1 and train.steps={t.steps} (or null)"
        )
    if t.memory_limit is not None:
        try:
            limit = parse_bytes(t.memory_limit, "train.memory_limit")
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if limit <= 0:
            raise ConfigError(f"train.memory_limit={t.memory_limit} must be positive")
    if m.vocab_size is not None and m.vocab_size <= 0:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} must be positive (or null: from tokenizer)"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if m.d_model % m.n_head:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}; "
            f"pick n_head among the divisors of d_model"
        )
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}; lower min_lr")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    if d.workers < 0:
        raise ConfigError(f"data.workers={d.workers} must be 0 (one per core) or positive")
    _check_mixture(d)
    if m.n_head % p.tp:
        raise ConfigError(
            f"model.n_head={m.n_head} is not divisible by parallel.tp={p.tp}; "
            f"attention heads are split across tensor-parallel ranks"
        )
    if p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError(
            f"model.seq_len={m.seq_len} is not divisible by parallel.tp={p.tp}; sequence "
            "parallelism splits each sequence into tp equal chunks"
        )
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence "
            "across tensor-parallel ranks); set parallel.tp or sequence_parallel=false"
        )
    window = t.seq_len or m.seq_len
    if t.seq_len is not None and not 1 <= t.seq_len <= m.seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} must be between 1 and model.seq_len={m.seq_len} "
            "(the longest sequence the model takes); lower it or set it to null"
        )
    if p.sequence_parallel and window % p.tp:
        raise ConfigError(
            f"train.seq_len={window} is not divisible by parallel.tp={p.tp}; sequence "
            "parallelism splits each sequence into tp equal chunks"
        )
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    try:  # the model's own rules (norms, grouped-query heads, MLP width, rotary) at this tp
        m.check()
        check_tp_shapes(m, p.tp, p.sequence_parallel)
    except ValueError as error:
        raise ConfigError(f"model.{error} (parallel.tp={p.tp})") from None


def _check_mixture(d: DataConfig) -> None:
    """Bad mixtures, before anything starts: each source needs files and a weight >= 0,
    and the weights a positive sum."""
    if d.mixture and d.files:
        raise ConfigError("data.files and data.mixture are both set; put the files in a source")
    for i, source in enumerate(d.mixture):
        if not source.files:
            raise ConfigError(f"data.mixture[{i}] names no files; give it files: [...]")
        if not math.isfinite(source.weight) or source.weight < 0:
            raise ConfigError(f"data.mixture[{i}].weight={source.weight} must be >= 0")
    if d.mixture and sum(source.weight for source in d.mixture) <= 0:
        raise ConfigError("data.mixture's weights sum to zero; give some source a weight > 0")


def validate_layout(config: Config, world_size: int) -> int:
    """Checks against the job's size; returns the data-parallel degree. Run before any
    process group exists so a bad layout fails fast on every rank alike."""
    p, t = config.parallel, config.train
    try:
        dp = check_layout(world_size, p.tp)
    except ValueError as error:
        raise ConfigError(f"parallel.tp: {error}") from None
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size x dp = {t.micro_batch_size} x {dp}; "
            f"use a multiple of {t.micro_batch_size * dp}"
        )
    return dp


def valid_keys() -> list[str]:
    """Every dotted key the config accepts, e.g. 'train.lr'."""
    return _valid_keys(Config)
