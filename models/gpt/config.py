"""The GPT architecture's hyper-parameters: GPT-2 by default, Llama-family options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


@dataclass
class GPTConfig:
    """Shape of a pre-norm decoder; the defaults are GPT-2 (Radford et al. 2019).

    `vocab_size` may stay None in a user config: the launcher fills it from the tokenizer,
    padded up to a multiple of 128 as Megatron does (fast GEMMs, and divisible by any
    power-of-two tensor-parallel degree up to 128). A checkpoint imported from Hugging Face
    keeps its exact vocabulary (models.gpt.hf.folder); the vocabulary-parallel layers pad it
    locally when it does not divide by tp.

    Llama (Touvron et al. 2023) is `norm="rmsnorm", mlp="swiglu", positions="rope",
    bias=False`, usually with `tie_embeddings=False` and, for grouped-query attention,
    `n_kv_head < n_head`.
    """

    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    seq_len: int = 1024
    dropout: float = 0.0
    vocab_size: int | None = None
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "gelu"
    d_ff: int | None = None  # hidden width of the MLP; None: see `ffn_dim`
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0  # base of the rotary frequencies (RoFormer, Su et al. 2021)
    n_kv_head: int | None = None  # key/value heads (GQA, Ainslie et al. 2023); None: n_head
    tie_embeddings: bool = True  # the token embedding doubles as the output layer
    bias: bool = True  # biases in every Linear and LayerNorm (GPT-2); Llama has none

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """`d_ff`, or by default 4 d_model for GELU (GPT-2) and, for SwiGLU, 2/3 of that
        rounded up to a multiple of 256: the three SwiGLU matrices then hold about the
        parameters of the two GELU ones (Shazeer 2020; Meta's Llama code, `multiple_of`)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return 256 * -(-(8 * self.d_model // 3) // 256)
        return 4 * self.d_model

    def check(self) -> None:
        """Raise ValueError naming the field for a value outside its allowed set or range
        (what does not depend on the parallel layout; see model.check_tp_shapes for that)."""
        for name, allowed in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"{name}={value!r} is not allowed; choose one of {'|'.join(allowed)}"
                )
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be positive")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"d_ff={self.d_ff} must be positive (or None for the default)")
        if self.n_kv_head is not None and self.n_kv_head <= 0:
            raise ValueError(f"n_kv_head={self.n_kv_head} must be positive (or None: n_head)")


def pad_vocab_size(n_tokens: int, multiple: int = 128) -> int:
    """Round a tokenizer's vocabulary up to the next multiple (Megatron's padding)."""
    return -(-n_tokens // multiple) * multiple
