"""Tensor parallelism against the single-process model (fp32, dropout 0 unless stated).

Tolerance: every logit and gathered gradient within 1e-5 relative of the tp=1 model, as
the norm of the difference over the norm of the reference (elementwise, entries near zero
carry the summation-order noise of fp32 and say nothing). A wrong split, a missing
reduction or an unmasked padding column moves them by orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch
import tp_cases

from hybrid.distributed.topology import check_layout
from hybrid.instruments.local_processes import run_processes
from models.gpt import GPT, GPTConfig
from models.gpt.model import check_tp_shapes

# Vocabulary 1001 does not divide by 2 or 4 (padding applies); 6 heads give 3 per rank at tp=2.
CONFIG_TP2 = GPTConfig(n_layer=2, n_head=6, d_model=48, seq_len=8, vocab_size=1001)
CONFIG_TP4 = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=8, vocab_size=1001)
# Llama options: RMSNorm, SwiGLU, rotary positions, 6 query heads on 2 kv heads (one per
# rank at tp=2), an untied output layer, no biases.
LLAMA_TP2 = GPTConfig(
    n_layer=2, n_head=6, d_model=48, seq_len=8, vocab_size=1001, norm="rmsnorm", mlp="swiglu",
    d_ff=40, positions="rope", n_kv_head=2, tie_embeddings=False, bias=False,
)  # fmt: skip


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    assert actual.shape == expected.shape, what
    error = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert error <= rel, f"{what}: relative error {error:.2e} > {rel:.0e}"


def assert_same_model(result: dict, ref: dict, rel: float = 1e-5) -> None:
    assert_relative(result["logits"], ref["logits"], rel, "logits")
    assert result["loss"] == pytest.approx(ref["loss"], rel=rel)
    assert result["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert_relative(result["grads"][name], grad, rel, f"grad of {name}")


@pytest.mark.parametrize(
    ("tp", "config"), [(2, CONFIG_TP2), (4, CONFIG_TP4), (2, LLAMA_TP2)], ids=["2", "4", "2-llama"]
)
def test_logits_and_gradients_match_single_process(tp: int, config: GPTConfig) -> None:
    ref = tp_cases.reference(config)
    ranks = run_processes(tp_cases.equivalence, tp, tp, config)
    for results in ranks:  # every rank holds the same gathered tensors
        for sequence_parallel in (False, True):
            assert_same_model(results[sequence_parallel], ref)


def test_padding_is_masked_in_the_loss() -> None:
    """A table padded 1001 -> 1024 rows, padding masked, gives the 1001-way model's loss."""
    exact = GPT(CONFIG_TP2, seed=tp_cases.SEED)
    padded = GPT(
        GPTConfig(**{**CONFIG_TP2.__dict__, "vocab_size": 1024}),
        seed=tp_cases.SEED,
        n_real_tokens=1001,
    )
    with torch.no_grad():  # same weights: the padded table's first 1001 rows are the table
        padded.wte.weight[:1001] = exact.wte.weight
    x, y = tp_cases.batch(CONFIG_TP2)
    assert padded(x, y).item() == pytest.approx(exact(x, y).item(), rel=1e-6)
    unmasked = GPT(padded.config, seed=tp_cases.SEED)
    unmasked.load_state_dict(padded.state_dict())
    assert unmasked(x, y).item() > exact(x, y).item() + 1e-3  # the mask matters


RECOMPUTE_GPT2 = GPTConfig(n_layer=3, n_head=4, d_model=32, seq_len=8, vocab_size=256, dropout=0.2)
RECOMPUTE_LLAMA = GPTConfig(**{**LLAMA_TP2.__dict__, "n_layer": 3, "dropout": 0.2})


def test_recompute_with_dropout_gives_identical_gradients() -> None:
    cases = [(RECOMPUTE_GPT2, False), (RECOMPUTE_GPT2, True), (RECOMPUTE_LLAMA, True)]
    all_results = run_processes(tp_cases.recompute_grads, 2, 2, cases)[0]
    for (config, sp), results in zip(cases, all_results, strict=True):
        base = results["none"]
        for name in ("selective", "full", "full-every-2"):
            what = f"{name}, {'llama' if config.mlp == 'swiglu' else 'gpt2'}, sp={sp}"
            assert results[name]["loss"] == pytest.approx(base["loss"], rel=1e-6), what
            for param, grad in base["grads"].items():
                torch.testing.assert_close(
                    results[name]["grads"][param],
                    grad,
                    rtol=1e-6,
                    atol=1e-7,
                    msg=f"{what}: {param}",
                )
        # Dropout is on: the gradients differ from the dropout-free model.
        no_dropout = tp_cases.reference(GPTConfig(**{**config.__dict__, "dropout": 0.0}))
        key = "blocks.0.attn.qkv.weight"
        reference = no_dropout["grads"][key]
        assert (base["grads"][key] - reference).norm() / reference.norm() > 0.05


def _per_layer(tp: int, sequence_parallel: bool) -> dict[str, dict[str, dict[str, int]]]:
    """TP collectives of a 2-layer model minus those of a 1-layer model, by phase and kind,
    for GPT-2 and for the Llama options (SwiGLU's gate and up are one column-parallel GEMM,
    GQA's q, k, v one: the same collectives)."""
    gpt2 = GPTConfig(n_head=4, d_model=32, seq_len=8, vocab_size=256)
    configs = [
        GPTConfig(**{**base.__dict__, "n_layer": layers})
        for base in (gpt2, LLAMA_TP2)
        for layers in (1, 2)
    ]
    counts = run_processes(tp_cases.collective_counts, tp, tp, configs, sequence_parallel)[0]
    result = {}
    for name, (one, two) in (("gpt2", counts[:2]), ("llama", counts[2:])):
        per_layer: dict[str, dict[str, int]] = {}
        for phase in ("forward", "backward"):
            kinds = {kind for kind, group in {*one[phase], *two[phase]} if group == "tp"}
            per_layer[phase] = {
                kind: two[phase].get((kind, "tp"), 0) - one[phase].get((kind, "tp"), 0)
                for kind in kinds
            }
            per_layer[phase] = {kind: n for kind, n in per_layer[phase].items() if n}
        result[name] = per_layer
    return result


def test_collectives_per_layer_megatron() -> None:
    """Megatron's f and g: two all-reduces forward, two backward, per transformer layer."""
    for layer in _per_layer(2, sequence_parallel=False).values():
        assert layer["forward"] == {"all_reduce": 2}
        assert layer["backward"] == {"all_reduce": 2}


def test_collectives_per_layer_sequence_parallel() -> None:
    """SP: each all-reduce becomes an all-gather plus a reduce-scatter. Forward: 2 gathers
    (before QKV and fc), 2 reduce-scatters (after the projections). Backward: their
    conjugates (2 reduce-scatters, 2 gathers) plus 2 gathers that re-build the column
    layers' inputs, which are stored as sequence chunks only (Korthikanti et al. 4.2.2)."""
    for layer in _per_layer(2, sequence_parallel=True).values():
        assert layer["forward"] == {"all_gather": 2, "reduce_scatter": 2}
        assert layer["backward"] == {"all_gather": 4, "reduce_scatter": 2}


def test_tp_random_streams() -> None:
    """tp=2 x dp=2: TP-region draws differ across TP ranks, agree across DP replicas and
    advance between regions; default-stream draws agree everywhere."""
    draws = run_processes(tp_cases.rng_streams, 4, 2)[0]  # rank r = dp_rank * 2 + tp_rank
    split, replicated, split_again = 0, 1, 2
    assert not torch.equal(draws[0][split], draws[1][split])  # TP ranks differ
    assert torch.equal(draws[0][split], draws[2][split])  # DP replicas agree
    assert torch.equal(draws[1][split], draws[3][split])
    assert not torch.equal(draws[0][split], draws[0][split_again])
    assert all(torch.equal(d[replicated], draws[0][replicated]) for d in draws)
    again = run_processes(tp_cases.rng_streams, 4, 2)[0]
    assert all(torch.equal(a, b) for a, b in zip(draws, again, strict=True))  # from the seed


def test_conjugate_operators() -> None:
    r0, r1 = run_processes(tp_cases.mapping_ops, 2)
    x = [torch.arange(8.0).reshape(4, 2) + 10 * r for r in range(2)]
    w = [
        lambda shape, r=r: torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 100 * r
        for r in range(2)
    ]
    both = (r0, r1)
    # f: identity forward, all-reduce backward.
    for r in range(2):
        assert torch.equal(both[r]["copy.y"], x[r])
        assert torch.equal(both[r]["copy.grad"], w[0]((4, 2)) + w[1]((4, 2)))
    # g: all-reduce forward, identity backward.
    for r in range(2):
        assert torch.equal(both[r]["reduce.y"], x[0] + x[1])
        assert torch.equal(both[r]["reduce.grad"], w[r]((4, 2)))
    # gather the last dim forward, split backward.
    for r in range(2):
        assert torch.equal(both[r]["gather_region.y"], torch.cat(x, dim=-1))
        assert torch.equal(both[r]["gather_region.grad"], w[r]((4, 4))[:, 2 * r : 2 * r + 2])
    # Along the sequence (dim 0): split/gather, gather/reduce-scatter, reduce-scatter/gather.
    for r in range(2):
        assert torch.equal(both[r]["scatter_seq.y"], x[r][2 * r : 2 * r + 2])
        assert torch.equal(both[r]["scatter_seq.grad"], torch.cat([w[0]((2, 2)), w[1]((2, 2))]))
        assert torch.equal(both[r]["gather_seq.y"], torch.cat(x, dim=0))
        summed = w[0]((8, 2)) + w[1]((8, 2))
        assert torch.equal(both[r]["gather_seq.grad"], summed[4 * r : 4 * r + 4])
        assert torch.equal(both[r]["reduce_scatter_seq.y"], (x[0] + x[1])[2 * r : 2 * r + 2])
        assert torch.equal(
            both[r]["reduce_scatter_seq.grad"], torch.cat([w[0]((2, 2)), w[1]((2, 2))])
        )


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="n_head=6 is not divisible by tp=4"):
        check_tp_shapes(GPTConfig(n_head=6, d_model=48), 4, False)
    with pytest.raises(ValueError, match="d_model=50 is not divisible by n_head=4"):
        check_tp_shapes(GPTConfig(n_head=4, d_model=50), 2, False)
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by tp=4"):
        check_tp_shapes(GPTConfig(n_head=4, d_model=32, seq_len=10), 4, True)
    with pytest.raises(ValueError, match="n_kv_head=2 is not divisible by tp=4"):
        check_tp_shapes(GPTConfig(n_head=8, n_kv_head=2, d_model=64), 4, False)
    with pytest.raises(ValueError, match="n_head=6 is not divisible by n_kv_head=4"):
        check_tp_shapes(GPTConfig(n_head=6, n_kv_head=4, d_model=48), 2, False)
    with pytest.raises(ValueError, match="MLP width 30 .* not divisible by tp=4"):
        check_tp_shapes(GPTConfig(n_head=4, d_model=32, d_ff=30), 4, False)
    with pytest.raises(ValueError, match="head_dim=5 .* must be even for rotary"):
        check_tp_shapes(GPTConfig(n_head=2, d_model=10, positions="rope"), 2, False)
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp=4"):
        check_layout(6, 4)
