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
LLAMA = GPTConfig(
    n_layer=3, n_head=6, d_model=48, seq_len=17, vocab_size=1001, norm="rmsnorm", mlp="swiglu",
    d_ff=40, positions="rope", n_kv_head=2, tie_embeddings=False, bias=False,
)  # fmt: skip
OPTIONS = [
    LLAMA,
    GPTConfig(**{**LLAMA.__dict__, "d_ff": None, "n_kv_head": None, "tie_embeddings": True}),
    GPTConfig(**{**CONFIGS[2].__dict__, "bias": False, "tie_embeddings": False, "d_ff": 100}),
    GPTConfig(**{**CONFIGS[2].__dict__, "norm": "rmsnorm", "positions": "rope", "n_kv_head": 3}),
]


@pytest.mark.parametrize("config", CONFIGS + OPTIONS)
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


def test_llama_options_build_the_llama_layers() -> None:
    model = GPT(LLAMA)
    names = dict(model.named_parameters())
    assert "wpe.weight" not in names and "lm_head.weight" in names
    assert not any(name.endswith("bias") for name in names)
    block = model.blocks[0]
    assert type(block.ln_1).__name__ == "RMSNorm" and torch.all(block.ln_1.weight == 1)
    assert block.attn.qkv.weight.shape == ((6 + 2 * 2) * 8, 48)  # 6 q heads, 2 k, 2 v
    assert block.mlp.fc.weight.shape == (2 * 40, 48)  # gate and up, interleaved
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    idx = torch.randint(0, 1001, (2, 17))
    assert model(idx).shape == (2, 17, 1001)
    loss = model(idx, idx)
    assert abs(loss.item() - math.log(1001)) < 0.5
    loss.backward()
    assert model.wte.weight.grad is not None and model.lm_head.weight.grad is not None


def test_rotary_positions_are_relative() -> None:
    """RoPE (Su et al. 2021): the score of q at position m and k at n depends on m - n."""
    from models.gpt.attention import apply_rotary, rotary_cos_sin

    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 12, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 12, 8)
    cos, sin = rotary_cos_sin(12, 8, 10000.0, torch.device("cpu"))
    scores = apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-2, -1)
    torch.testing.assert_close(scores[0, 0, 5, 2], scores[0, 0, 9, 6])
    assert not torch.allclose(scores[0, 0, 5, 2], scores[0, 0, 5, 3])


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="norm='batchnorm' is not allowed; choose one of"):
        GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, vocab_size=16, norm="batchnorm"))
    with pytest.raises(ValueError, match="n_kv_head=0 must be positive"):
        GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, vocab_size=16, n_kv_head=0))


@pytest.mark.parametrize("mode", [Recompute.SELECTIVE, Recompute.FULL])
@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
def test_recompute_gives_identical_gradients_with_dropout(mode: Recompute, llama: bool) -> None:
    config = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=128, dropout=0.2)
    if llama:
        config = GPTConfig(**{**LLAMA.__dict__, "seq_len": 16, "vocab_size": 128, "dropout": 0.2})
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
