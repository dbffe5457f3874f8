"""The GPT architecture's hyper-parameters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    """Shape of a GPT-2 style decoder.

    `vocab_size` may stay None in a user config: the launcher fills it from the tokenizer,
    padded up to a multiple of 128 as Megatron does (fast GEMMs, and divisible by any
    power-of-two tensor-parallel degree up to 128).
    """

    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    seq_len: int = 1024
    dropout: float = 0.0
    vocab_size: int | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def pad_vocab_size(n_tokens: int, multiple: int = 128) -> int:
    """Round a tokenizer's vocabulary up to the next multiple (Megatron's padding)."""
    return -(-n_tokens // multiple) * multiple
