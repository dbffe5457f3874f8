"""Construction at scale: a model on the meta device, each rank materialising only its shard."""

from __future__ import annotations

import dataclasses

import torch
from zero_cases import meta_stage3_weights

from hybrid.comm import VirtualGroup
from hybrid.engine import build_buckets
from hybrid.tensor_parallel import TensorParallel, TPRandom
from hybrid.testing import run_processes
from launch.config import PRESET_DIR, load_config
from models.gpt import GPT, GPTConfig, pad_vocab_size
from models.gpt.accounting import count_parameters


def test_turing_nlg_shard_shapes_at_tp4_dp64_without_allocation() -> None:
    """The 17B preset at tp=4: per-rank shard sizes for dp=64 from shapes alone."""
    config = load_config(PRESET_DIR / "turing-nlg-17b.yaml").model
    config = dataclasses.replace(config, vocab_size=pad_vocab_size(50257))
    tp_rank, tp, dp = 1, 4, 64
    parallel = TensorParallel(
        VirtualGroup("tp", tp, tp_rank), False, TPRandom(0, tp_rank, torch.device("cpu"))
    )
    model = GPT(config, parallel, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())

    buckets = build_buckets(model, list(model.blocks), dp, dp_rank=63)
    psi_rank = sum(p.numel() for p in model.parameters())  # this TP rank's parameters
    assert sum(b.numel - b.padding for b in buckets) == psi_rank
    shard = sum(b.shard_numel for b in buckets)
    assert shard * dp == psi_rank + sum(b.padding for b in buckets)
    assert all(b.padding < dp for b in buckets)
    # The TP split: matrices and the vocabulary divide by 4, LayerNorms and the row-parallel
    # biases and position table are replicated.
    h, layers = config.d_model, config.n_layer
    replicated = layers * (4 * h + 2 * h) + config.seq_len * h + 2 * h
    total = count_parameters(config)
    assert psi_rank == (total - replicated) // tp + replicated
    assert 17.0e9 < total < 17.5e9 and 66e6 < shard < 68e6  # ~17.2B / 256 ranks
    assert all(p.device.type == "meta" for p in model.parameters())  # still nothing allocated


def test_meta_model_materialised_at_stage3_equals_the_tp1_model() -> None:
    """tp=2 x dp=2, ZeRO-3, built on meta: gathered weights equal the tp=1 model's, and each
    rank allocated only its shard."""
    config = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=203)
    reference = GPT(config, seed=11).state_dict()
    results = run_processes(meta_stage3_weights, 4, config, 11)
    for weights, shard_elements in results:
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(weights[name], tensor), name
        assert shard_elements < sum(t.numel() for t in reference.values()) / 3
