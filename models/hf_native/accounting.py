"""What the planner and MFU need of a Hugging Face model trained as it is, counted from
the module on meta (no weights): parameters outside and inside each unit (the Engine's
buckets, each parameter once), the shape activation memory depends on, FLOPs per token."""

from __future__ import annotations

from hybrid.memory import RankParameters
from hybrid.memory.activations import TransformerShape
from models.hf_native.causal_lm import HFCausalLM


def native_rank_parameters(model: HFCausalLM) -> RankParameters:
    """Elements of bucket 0 (everything outside the units: embeddings, final norm, an
    untied head) and of each unit, as hybrid.zero.bucket lays them out (tp=1)."""
    in_units = {id(p) for unit in model.units for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    units = tuple(sum(p.numel() for p in unit.parameters()) for unit in model.units)
    total = sum(p.numel() for p in model.parameters())
    return RankParameters(root=root, units=units, replicated=0, total=total)


def native_shape(model: HFCausalLM, seq_len: int, device_type: str = "cpu") -> TransformerShape:
    """The decoder's dimensions for hybrid.memory.activations (Korthikanti et al.'s
    per-layer count, which assumes a GPT-like layer: an estimate for other layers)."""
    c = model.config
    gated = any("gate" in name for name, _ in model.units[0].named_parameters())
    return TransformerShape(
        layers=c.n_layer,
        hidden=c.d_model,
        heads=c.n_head,
        kv_heads=c.kv_heads,
        head_dim=c.d_model // c.n_head,
        ffn=c.ffn_dim,
        gated_mlp=gated,
        vocab=c.vocab_size,
        seq_len=seq_len,
        dropout=False,
        dropout_in_kernel=device_type == "cuda",
        tied_embeddings=c.tie_embeddings,
    )


def native_flops_per_token(model: HFCausalLM, seq_len: int, full_recompute: bool = False) -> float:
    """Training FLOPs per token as models.gpt.accounting.flops_per_token counts them
    (Narayanan et al. 2021, eq. 3): 2 per matrix parameter of the layers and 4 h s of
    attention a layer forward, backward twice that, a recomputed forward once more; the
    logits 2 V h forward."""
    c = model.config
    matrices = sum(p.numel() for unit in model.units for p in unit.parameters() if p.dim() >= 2)
    layer_forward = 2 * matrices + 4 * c.n_layer * c.d_model * seq_len
    passes = 4 if full_recompute else 3
    return passes * layer_forward + 3 * 2 * c.vocab_size * c.d_model
