"""Checks of a loaded Config: those that need no job size (`validate`) and those against
the world size (`validate_layout`), all raised before any process group exists."""

from __future__ import annotations

import math

from hybrid.distributed.topology import check_layout
from hybrid.memory.units import parse_bytes
from launch.config.sections import Config, DataConfig
from launch.config.tree import ConfigError
from models.gpt.model import check_tp_shapes


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
        "parallel.bucket_mb": p.bucket_mb,
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
    if config.model_source == "hf":
        _check_hf_native(config)
    try:  # the model's own rules (norms, grouped-query heads, MLP width, rotary) at this tp
        m.check()
        check_tp_shapes(m, p.tp, p.sequence_parallel)
    except ValueError as error:
        raise ConfigError(f"model.{error} (parallel.tp={p.tp})") from None


def _check_hf_native(config: Config) -> None:
    """A Hugging Face model trained as it is: data parallelism only, whole-layer
    recomputation only (our selective recompute is a rewrite of our attention)."""
    p = config.parallel
    if p.tp != 1:
        raise ConfigError(
            f"model_source=hf trains the model as it is, with ZeRO over data parallelism "
            f"only: parallel.tp={p.tp} needs our layers; set parallel.tp=1, or "
            "model_source=gpt (GPT-2 and Llama families convert to our GPT)"
        )
    if p.recompute == "selective":
        raise ConfigError(
            "parallel.recompute=selective rewrites our attention; with model_source=hf use "
            "recompute=full (each layer recomputed whole) or none"
        )
    if config.data.pack:
        raise ConfigError(
            "data.pack=true needs segment masks in attention, which a model trained as it "
            "is lacks; set data.pack=false with model_source=hf"
        )


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
