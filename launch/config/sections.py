"""The config's sections as dataclasses: the YAML keys, their defaults and allowed values.

The section and key names are the user-facing contract; rename nothing without a shim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from models.gpt import GPTConfig


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
    # Stages 0-2: consecutive units share one gradient/parameter bucket up to this many MiB
    # (DeepSpeed's reduce_bucket_size, Megatron's bucket_size): fewer, larger collectives
    # against a larger filling bucket. Stage 3 buckets unit by unit.
    bucket_mb: float = 25.0


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
    # launch.finetune: "gpt" converts the folder into our GPT (GPT-2 and Llama families, any
    # tp); "hf" trains the transformers model as it is (any AutoModelForCausalLM, tp=1).
    model_source: Literal["gpt", "hf"] = "gpt"
    dist_timeout_s: float = 600.0  # collective timeout before a stuck job is torn down
