"""Construction at scale: a model on the meta device, each rank materialising only its shard."""

from __future__ import annotations

import dataclasses

import torch
from zero_cases import meta_stage3_weights

from hybrid.distributed.comm import VirtualGroup
from hybrid.engine import build_buckets
from hybrid.instruments.local_processes import run_processes
from hybrid.tensor_parallel import TensorParallel, TPRandom, parameter_shards
from launch.config import load_config, preset_path
from models.gpt import GPT, GPTConfig, pad_vocab_size
from models.gpt.accounting import count_parameters


def test_turing_nlg_shard_shapes_at_tp4_dp64_without_allocation() -> None:
    """The 17B preset at tp=4: per-rank shard sizes for dp=64 from shapes alone."""
    config = load_config(preset_path("turing-nlg-17b")).model
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


def tp_layout(config: GPTConfig, tp: int) -> tuple[dict[str, int], set[str]]:
    """Per parameter, the elements one TP rank holds (padding included), and the names of
    the TP-split parameters: shapes only (meta)."""
    parallel = TensorParallel(VirtualGroup("tp", tp, 0), False, TPRandom(0, 0, torch.device("cpu")))
    model = GPT(config, parallel, device="meta")
    return {n: p.numel() for n, p in model.named_parameters()}, set(parameter_shards(model))


def test_meta_model_materialised_at_stage3_equals_the_tp1_model() -> None:
    """tp=2 x dp=2, ZeRO-3, built on meta: the gathered weights equal the tp=1 model's
    bitwise; each rank holds only its shard, and draws only the random values of it.

    The bound on the draws, per rank: the elements of its DP shard of its TP slice,
    Psi_local / dp + one element per bucket (each bucket is padded to a multiple of dp),
    where Psi_local is one TP rank's parameters, padding included (the split ones / tp,
    a replicated one whole). And exactly: over all ranks, each random value of the tp=1
    model is drawn once per TP rank that keeps it (once if split, tp times if replicated,
    never for vocabulary padding), so no DP rank draws what another keeps."""
    tp, dp, seed = 2, 2, 11
    config = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=203)
    tp1 = GPT(config, seed=seed)
    reference = tp1.state_dict()
    local, split = tp_layout(config, tp)
    random_numel = {n: t.numel() for n, t in reference.items() if tp1._init_rule(n, t.shape).std}
    n_buckets = config.n_layer + 1  # one per block, and the root bucket
    bound = sum(local.values()) / dp + n_buckets
    assert bound < 0.3 * sum(t.numel() for t in reference.values())  # ~1/(tp dp) here

    results = run_processes(meta_stage3_weights, tp * dp, config, seed)
    for result in results:
        weights = result["weights"]
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(weights[name], tensor), name
        assert result["held"] <= bound
        assert 0 < result["drawn"] <= result["held"]
    expected = sum(n if name in split else tp * n for name, n in random_numel.items())
    assert sum(r["drawn"] for r in results) == expected
