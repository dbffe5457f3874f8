"""A plain-PyTorch twin of our GPT (models/gpt) for the peers: nn.Linear, nn.Embedding and
nn.LayerNorm only, so DDP, FSDP2, DTensor's `parallelize_module` and DeepSpeed take it as
it is.

Same math as our GPT-2 configuration: pre-norm blocks, learned positions, causal SDPA, a
tanh-GELU MLP, a final LayerNorm and the output layer tied to the token embedding, mean
cross-entropy. The parameter names are ours, so `load_state_dict` takes our tp=1 state dict
unchanged. The QKV features are ordered (head, q|k|v, head_dim), as in ours: a contiguous
slice of them holds whole heads, so DTensor's ColwiseParallel split of `qkv` is a head
split, and the attention infers its local head count from the features it receives.

Activations are (batch, sequence, features), the usual layout of a plain model; ours are
(sequence, batch, features). Full recomputation wraps each block in torch's non-reentrant
checkpoint, as ours does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from models.gpt import GPTConfig


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, heads * 3 * d) -> three (b, heads, s, d); heads is local under TP.
        q, k, v = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim)).transpose(1, 2).unbind(-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ffn_dim)
        self.proj = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._layer, x, use_reentrant=False)
        return self._layer(x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    def __init__(self, config: GPTConfig, recompute: bool = False) -> None:
        super().__init__()
        check_supported(config)
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config, recompute) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.logits(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), _like(targets, logits).flatten(0, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The tied output layer. Under DTensor TP the embedding's weight is split by
        vocabulary rows (Shard(0)); the replicated hidden states then give logits split by
        vocabulary (Shard(-1)), which `loss_parallel` takes without gathering them, and the
        gradient flowing back to x is summed over TP (Megatron's f)."""
        weight = self.wte.weight
        if isinstance(weight, DTensor):
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim)
        return F.linear(x, weight)


def _like(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Targets as a replicated DTensor when the logits are a DTensor (loss_parallel)."""
    if not isinstance(logits, DTensor):
        return targets
    mesh = logits.device_mesh
    return DTensor.from_local(targets, mesh, [Replicate()] * mesh.ndim)


def check_supported(config: GPTConfig) -> None:
    """The twin covers our GPT-2 configuration only; refuse the Llama options."""
    unsupported = {
        "norm": config.norm != "layernorm",
        "mlp": config.mlp != "gelu",
        "positions": config.positions != "learned",
        "n_kv_head": config.kv_heads != config.n_head,
        "tie_embeddings": not config.tie_embeddings,
        "bias": not config.bias,
        "dropout": config.dropout != 0.0,
        "d_ff": config.ffn_dim != 4 * config.d_model,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"PlainGPT mirrors the GPT-2 configuration only; unsupported: {bad}")


def from_state(
    config: GPTConfig, state: dict[str, torch.Tensor], recompute: bool = False
) -> PlainGPT:
    """The twin with our tp=1 weights (names and shapes must match exactly)."""
    model = PlainGPT(config, recompute)
    model.load_state_dict(state, strict=True)
    return model
