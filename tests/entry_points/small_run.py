"""A few-second training job on the small corpus, shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def small_run_overrides(corpus: Path, cache_dir: Path, run_dir: Path) -> list[str]:
    """A 2-layer model, 320-token BPE, sequences of 32, global batch 8 in micro-batches of 2."""
    return [
        f"data.files=[{corpus}]",
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=320",
        f"data.cache_dir={cache_dir}",
        f"run_dir={run_dir}",
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        "model.seq_len=32",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.warmup_steps=2",
        "tracking.wandb.mode=disabled",
    ]
