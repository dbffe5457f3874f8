"""Which Hugging Face family a config is, and the configs in both directions: GPT-2
(GPT2LMHeadModel) and Llama (LlamaForCausalLM). transformers is imported only where a
Hugging Face config is built (its import pulls in the Auto mappings)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.gpt.config import GPTConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def config_from_hf(hf_config: PretrainedConfig) -> GPTConfig:
    """Our config for a Hugging Face GPT2Config or LlamaConfig; ValueError for an option
    we do not implement (it names the field)."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        return _gpt2_config(hf_config)
    if kind == "llama":
        return _llama_config(hf_config)
    raise ValueError(f"Hugging Face model_type {kind!r} is not supported (gpt2, llama are)")


def hf_config(config: GPTConfig) -> PretrainedConfig:
    """The Hugging Face config (GPT2Config or LlamaConfig) for ours; ValueError when no
    Hugging Face class matches."""
    return _gpt2_hf_config(config) if family_of(config) == "gpt2" else _llama_hf_config(config)


def family_of(config: GPTConfig) -> str:
    """The Hugging Face family (gpt2 or llama) whose architecture this config describes."""
    options = (config.norm, config.mlp, config.positions, config.bias)
    if options == ("layernorm", "gelu", "learned", True) and config.kv_heads == config.n_head:
        return "gpt2"
    if options == ("rmsnorm", "swiglu", "rope", False):
        return "llama"
    raise ValueError(
        f"no Hugging Face class matches norm={config.norm}, mlp={config.mlp}, "
        f"positions={config.positions}, bias={config.bias}, n_kv_head={config.kv_heads}: "
        "GPT-2 is layernorm/gelu/learned/bias, Llama is rmsnorm/swiglu/rope/no bias"
    )


def _gpt2_config(hf: PretrainedConfig) -> GPTConfig:
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"GPT-2 activation_function={hf.activation_function!r} is not supported; "
            "ours is the tanh GELU (gelu_new)"
        )
    for field, wanted in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if getattr(hf, field, wanted) != wanted:
            raise ValueError(f"GPT-2 {field}={getattr(hf, field)} is not supported")
    return GPTConfig(
        n_layer=hf.n_layer,
        n_head=hf.n_head,
        d_model=hf.n_embd,
        seq_len=hf.n_positions,
        dropout=float(hf.resid_pdrop),  # one rate for residual, embedding and attention
        vocab_size=hf.vocab_size,
        norm_eps=hf.layer_norm_epsilon,
        d_ff=hf.n_inner,
        tie_embeddings=hf.tie_word_embeddings,
    )


def _gpt2_hf_config(config: GPTConfig) -> PretrainedConfig:
    from transformers import GPT2Config  # here: its import pulls in the Auto mappings

    in_vocab = config.vocab_size is not None and config.vocab_size > 50256

    return GPT2Config.from_dict(
        {
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": config.vocab_size,
            "n_positions": config.seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.d_ff,
            "activation_function": "gelu_new",
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "layer_norm_epsilon": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            # GPT-2's <|endoftext|> is 50256; a smaller vocabulary is another tokenizer's.
            "bos_token_id": 50256 if in_vocab else None,
            "eos_token_id": 50256 if in_vocab else None,
        }
    )


def _llama_config(hf: PretrainedConfig) -> GPTConfig:
    if hf.hidden_act != "silu":
        raise ValueError(f"Llama hidden_act={hf.hidden_act!r} is not supported (silu is)")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf, field, False):
            raise ValueError(f"Llama {field}=True is not supported (biases are off)")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim not in (None, hf.hidden_size // hf.num_attention_heads):
        raise ValueError(
            f"Llama head_dim={head_dim} != hidden_size / num_attention_heads is not supported"
        )
    kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return GPTConfig(
        n_layer=hf.num_hidden_layers,
        n_head=hf.num_attention_heads,
        d_model=hf.hidden_size,
        seq_len=hf.max_position_embeddings,
        dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        vocab_size=hf.vocab_size,
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        mlp="swiglu",
        d_ff=hf.intermediate_size,
        positions="rope",
        rope_theta=_rope_theta(hf),
        n_kv_head=None if kv == hf.num_attention_heads else kv,
        tie_embeddings=hf.tie_word_embeddings,
        bias=False,
    )


def _rope_theta(hf: PretrainedConfig) -> float:
    """The rotary base; only plain RoPE (no scaling of the frequencies) is implemented.
    transformers >= 5 keeps it in `rope_parameters`, 4.x in `rope_theta`/`rope_scaling`."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"Llama rope scaling {kind!r} is not supported (plain RoPE is)")
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _llama_hf_config(config: GPTConfig) -> PretrainedConfig:
    # from_dict takes `rope_theta` in both transformers 4.x and 5.x.
    from transformers import LlamaConfig  # here: as GPT2Config

    return LlamaConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "intermediate_size": config.ffn_dim,
            "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.seq_len,
            "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta,
            "attention_dropout": config.dropout,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }
    )
