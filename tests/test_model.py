"""The GPT-2 model: shapes, parameter count, FLOPs, initialisation, recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid.recompute import Recompute, RecomputePolicy
from models.gpt import GPT, GPTConfig, count_parameters, flops_per_token, pad_vocab_size

CONFIGS = [
    GPTConfig(n_layer=1, n_head=1, d_model=8, seq_len=4, vocab_size=16),
    GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=384),
    GPTConfig(n_layer=3, n_head=6, d_model=48, seq_len=17, vocab_size=1000),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_parameter_count_matches_formula(config: GPTConfig) -> None:
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)


def test_parameter_count_of_gpt2_small() -> None:
    # GPT-2 124M with the vocabulary padded 50257 -> 50304: nanoGPT's 124,475,904.
    config = GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304)
    assert count_parameters(config) == 124_475_904


def test_flops_per_token_matches_megatron_formula() -> None:
    config = GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304)
    layers, h, s, v = 12, 768, 1024, 50304
    megatron = 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))  # no recompute
    assert flops_per_token(config) == pytest.approx(megatron, rel=1e-12)
    with_recompute = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    assert flops_per_token(config, full_recompute=True) == pytest.approx(with_recompute, rel=1e-12)


def test_shapes_and_loss() -> None:
    config = CONFIGS[1]
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (3, config.seq_len))
    assert model(idx).shape == (3, config.seq_len, config.vocab_size)
    assert model(idx[:, :5]).shape == (3, 5, config.vocab_size)
    loss = model(idx, torch.randint(0, config.vocab_size, idx.shape))
    # At initialisation the logits are small: the loss is close to uniform guessing.
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, config.seq_len + 1, dtype=torch.long))


def test_embeddings_tied_and_gpt2_init() -> None:
    config = GPTConfig(n_layer=8, n_head=4, d_model=256, seq_len=64, vocab_size=512)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 512, (1, 8))
    model(idx, idx).backward()
    # One tensor serves input and output: the output layer's gradient lands in wte.
    assert model.wte.weight.grad is not None
    assert not any("lm_head" in n for n, _ in model.named_parameters())
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln_1.weight == 1)


@pytest.mark.parametrize("mode", [Recompute.SELECTIVE, Recompute.FULL])
def test_recompute_gives_identical_gradients_with_dropout(mode: Recompute) -> None:
    config = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=128, dropout=0.2)
    idx = torch.randint(0, 128, (4, 16))
    grads = []
    for recompute in (Recompute.NONE, mode):
        torch.manual_seed(0)
        model = GPT(config, recompute=RecomputePolicy(recompute))
        model(idx, idx).backward()  # same seed: same dropout masks, restored in recompute
        grads.append([p.grad.clone() for p in model.parameters()])
    for reference, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, reference, rtol=0, atol=0)


def test_dropout_is_active_in_training_only() -> None:
    config = GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=128, dropout=0.5)
    model = GPT(config)
    idx = torch.randint(0, 128, (2, 16))
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_generate_never_samples_vocab_padding() -> None:
    config = GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=8, vocab_size=128)
    model = GPT(config, n_real_tokens=100).eval()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 40, temperature=5.0, top_k=None)
    assert out.shape == (1, 41) and int(out.max()) < 100


def test_pad_vocab_size() -> None:
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(2048) == 2048
    assert pad_vocab_size(1) == 128
