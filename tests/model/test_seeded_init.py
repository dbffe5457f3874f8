"""The counter-based initialisation: the generator itself, and each TP rank drawing only the
values of its slice, bitwise equal to the tp=1 model's."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from hybrid.distributed.comm import VirtualGroup
from hybrid.tensor_parallel import TensorParallel, TPRandom, parameter_shards, seeded, shards
from hybrid.tensor_parallel.seeded import seeded_normal
from hybrid.tensor_parallel.shards import local_slice
from models.gpt import GPT, GPTConfig

N = 1_000_000
SIGMAS = 5  # every statistical check: within 5 standard errors (a false alarm ~ 1e-6)


def normal_tail(x: float) -> float:
    """P(|z| > x) for z ~ N(0, 1)."""
    return math.erfc(x / math.sqrt(2))


def test_a_value_depends_only_on_seed_name_and_index() -> None:
    """Any subset, in any order, in any chunking, gives the full draw's values bitwise."""
    full = seeded_normal(3, "w", torch.arange(300_000))
    g = torch.Generator().manual_seed(0)
    picks = [
        torch.randperm(300_000, generator=g)[:5000],
        torch.arange(299_999, -1, -7),
        torch.tensor([0]),
        torch.tensor([123_457]),
        torch.arange(65_530, 65_600).view(7, 10),  # across a chunk boundary, 2-D
    ]
    for index in picks:
        assert torch.equal(seeded_normal(3, "w", index), full[index])
    with mock.patch.object(seeded, "CHUNK_PER_THREAD", 1000):
        assert torch.equal(seeded_normal(3, "w", torch.arange(300_000)), full)
    assert seeded_normal(3, "w", torch.tensor([], dtype=torch.int64)).numel() == 0


def test_the_high_word_of_the_index_matters() -> None:
    """Elements 2^32 apart (the same low word) are different values, and uncorrelated."""
    low = seeded_normal(0, "w", torch.arange(100_000))
    high = seeded_normal(0, "w", torch.arange(100_000) + (1 << 32))
    assert torch.corrcoef(torch.stack([low, high]))[0, 1].abs() < SIGMAS / math.sqrt(100_000)
    assert not torch.equal(low, high)


def test_moments_and_tails_are_standard_normal() -> None:
    z = seeded_normal(0, "blocks.0.mlp.fc.weight", torch.arange(N))
    assert z.dtype == torch.float32 and z.isfinite().all()
    z = z.double()
    assert z.mean().abs() < SIGMAS / math.sqrt(N)
    assert (z.std() - 1).abs() < SIGMAS / math.sqrt(2 * N)
    assert ((z**4).mean() - 3).abs() < SIGMAS * math.sqrt(96 / N)  # Var z^4 = 105 - 9
    for x in (1.0, 2.0, 3.0):
        p = normal_tail(x)
        assert abs((z.abs() > x).double().mean() - p) < SIGMAS * math.sqrt(p * (1 - p) / N)


@pytest.mark.parametrize("lag", [1, 2, 1024])
def test_nearby_indices_are_uncorrelated(lag: int) -> None:
    z = seeded_normal(7, "wte.weight", torch.arange(N)).double()
    assert torch.corrcoef(torch.stack([z[:-lag], z[lag:]]))[0, 1].abs() < SIGMAS / math.sqrt(N)


def test_names_and_seeds_give_different_streams() -> None:
    index = torch.arange(N)
    streams = [seeded_normal(s, n, index).double() for s, n in ((0, "a"), (0, "b"), (1, "a"))]
    corr = torch.corrcoef(torch.stack(streams))
    assert corr.triu(1).abs().max() < SIGMAS / math.sqrt(N)
    assert not torch.equal(streams[0], streams[1]) and not torch.equal(streams[0], streams[2])


def lowbias32(x: int) -> int:
    """The hash on Python integers (no overflow possible): the reference for int64 tensors."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_int64_hash_is_exact_32_bit_arithmetic() -> None:
    g = torch.Generator().manual_seed(1)
    words = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    words += torch.randint(0, 1 << 32, (2000,), generator=g).tolist()
    mixed = seeded._mix(torch.tensor(words, dtype=torch.int64)).tolist()
    assert mixed == [lowbias32(w) for w in words]


def test_log_and_cos_match_the_math_library() -> None:
    """ln and cos are written from basic arithmetic (bitwise portable); they are accurate."""
    g = torch.Generator().manual_seed(2)
    words = [0, 1, 1 << 30, 1 << 31, 3 << 30, 0xFFFFFFFF]
    words += torch.randint(0, 1 << 32, (5000,), generator=g).tolist()
    w = torch.tensor(words, dtype=torch.int64)
    logs, coss = seeded._log_u1(w).tolist(), seeded._cos_turn(w).tolist()
    for word, log, cos in zip(words, logs, coss, strict=True):
        assert log == pytest.approx(math.log((word + 1) / 2**32), rel=1e-15, abs=1e-15)
        assert cos == pytest.approx(math.cos(2 * math.pi * word / 2**32), abs=1e-15)


CONFIGS = {
    "gpt2": GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=203),
    "llama": GPTConfig(
        n_layer=2,
        n_head=8,
        n_kv_head=4,
        d_model=32,
        seq_len=16,
        vocab_size=201,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        bias=False,
        tie_embeddings=False,
    ),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_each_tp_rank_draws_only_its_slice_of_the_tp1_model(kind: str, tp: int) -> None:
    """A model built at tp (one process plays each rank) equals the tp=1 model's slices
    bitwise, vocabulary padding zero; each rank draws exactly the random elements of its
    slice: its rows (or columns) of a split parameter, padding excluded; a replicated one
    whole."""
    config, seed = CONFIGS[kind], 5
    tp1 = GPT(config, seed=seed)
    reference = tp1.state_dict()
    drawn = []
    for rank in range(tp):
        parallel = TensorParallel(
            VirtualGroup("tp", tp, rank), False, TPRandom(seed, rank, torch.device("cpu"))
        )
        with mock.patch.object(shards, "seeded_normal", wraps=shards.seeded_normal) as draw:
            model = GPT(config, parallel, seed=seed)
        drawn.append(sum(call.args[2].numel() for call in draw.call_args_list))
        specs = parameter_shards(model)
        for name, param in model.named_parameters():
            assert torch.equal(param, local_slice(reference[name], specs.get(name), rank)), name
            start = param.numel() // 3  # any range of the flattened slice
            part = model.initial_values(name, start, param.numel())
            assert torch.equal(part, param.detach().reshape(-1)[start:]), name
    random_numel = {n: t.numel() for n, t in reference.items() if tp1._init_rule(n, t.shape).std}
    for rank in range(tp):
        expected = 0
        for name, n in random_numel.items():
            spec = specs.get(name)
            if spec is None:
                expected += n  # replicated: every rank keeps (and draws) all of it
                continue
            width = -(-spec.logical_size // tp)
            real = max(0, min(spec.logical_size, (rank + 1) * width) - rank * width)
            expected += n // spec.logical_size * real
        assert drawn[rank] == expected
