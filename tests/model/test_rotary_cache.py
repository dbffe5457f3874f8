"""RoPE's cos/sin tables are computed once per (sequence length, device, dtype), not in
every layer at every step: counted at torch's dispatcher (aten.cos calls), with logits and
gradients bitwise those of the uncached computation."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import models.gpt.attention as attention
from models.gpt import GPT, GPTConfig

LLAMA = GPTConfig(
    n_layer=3, n_head=4, d_model=32, seq_len=16, vocab_size=64, norm="rmsnorm", mlp="swiglu",
    d_ff=48, positions="rope", n_kv_head=2, tie_embeddings=False, bias=False,
)  # fmt: skip


class _CosCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.cos.default
        return func(*args, **(kwargs or {}))


def _step(model: GPT, idx: torch.Tensor) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with _CosCalls() as counted:
        loss = model(idx, idx.roll(-1, dims=1))
        loss.backward()
    return counted.calls, loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_tables_are_computed_once_and_change_nothing(monkeypatch) -> None:
    attention._cached_rotary_table.cache_clear()
    model = GPT(LLAMA, seed=1)
    idx = torch.randint(0, 64, (2, 16))
    first, loss, grads = _step(model, idx)
    again, loss_again, _ = _step(model, idx)
    assert (first, again) == (1, 0)  # one table for 3 layers, none at the next step
    shorter, _, _ = _step(model, idx[:, :8])
    assert shorter == 1  # another length: its own table

    def uncached(seq, head_dim, theta, like):
        cos, sin = attention.rotary_cos_sin(seq, head_dim, theta, like.device)
        return cos.to(like.dtype), sin.to(like.dtype)

    monkeypatch.setattr(attention, "rotary_table", uncached)
    every_layer, loss_plain, grads_plain = _step(model, idx)
    assert every_layer == LLAMA.n_layer
    assert torch.equal(loss, loss_plain) and torch.equal(loss, loss_again)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_plain, strict=True))


def test_inference_mode_tables_are_not_kept_for_training() -> None:
    attention._cached_rotary_table.cache_clear()
    model = GPT(LLAMA, seed=1)
    idx = torch.randint(0, 64, (1, 16))
    with torch.inference_mode():
        model(idx)
    model(idx, idx).backward()  # an inference tensor saved for backward would raise here
