"""Hugging Face import/export: our GPT equals transformers' GPT2LMHeadModel and
LlamaForCausalLM (logits within 1e-5 relative, the same loss) at tp=1 and tp=2, and an
exported folder loads back with from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import hf_cases
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hybrid.distributed.comm import VirtualGroup
from hybrid.instruments.local_processes import run_processes
from hybrid.tensor_parallel import TensorParallel, TPRandom, parameter_shards
from hybrid.tensor_parallel.shards import local_slice
from models.gpt import GPT, GPTConfig
from models.gpt.hf.folder import (
    config_from_hf,
    hf_to_ours,
    ours_to_hf,
    read_hf_folder,
    read_hf_weights,
    write_hf_folder,
)

FAMILIES = ("gpt2", "llama")
LLAMA_LIKE = GPTConfig(
    n_layer=2, n_head=6, d_model=48, seq_len=16, vocab_size=1001, norm="rmsnorm",
    mlp="swiglu", d_ff=72, positions="rope", n_kv_head=3, tie_embeddings=False, bias=False,
)  # fmt: skip


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    assert actual.shape == expected.shape, what
    error = (actual - expected).norm() / expected.norm()
    assert error <= rel, f"{what}: relative error {error:.2e} > {rel:.0e}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """family -> (a save_pretrained folder of a random model, transformers' outputs)."""
    out = {}
    for family in FAMILIES:
        model = hf_cases.make_hf(family)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = (folder, hf_cases.hf_reference(model))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers(checkpoints: dict, family: str) -> None:
    folder, reference = checkpoints[family]
    config, weights = read_hf_folder(folder)
    assert config.vocab_size == hf_cases.VOCAB  # exact, not padded
    result = hf_cases.ours(GPT(config, init_weights=weights).eval())
    assert_relative(result["logits"], reference["logits"], 1e-5, f"{family} logits")
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)


def test_import_at_tp2_matches_transformers(checkpoints: dict) -> None:
    """tp=2 (vocabulary 1001 padded locally), with and without sequence parallelism (the
    gradient norm of a backward, with full recompute under SP, equal to transformers'),
    and built on the meta device then materialised by a ZeRO-3 Engine."""
    folders = {family: str(folder) for family, (folder, _) in checkpoints.items()}
    ranks = run_processes(hf_cases.tp2_imports, 2, folders)
    for results in ranks:
        for family, (_, reference) in checkpoints.items():
            for sp in (False, True):
                got = results[f"{family}/sp={sp}"]
                what = f"{family} tp=2 sp={sp}"
                assert_relative(got["logits"], reference["logits"], 1e-5, what)
                assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), what
                assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), what
            assert results[f"{family}/zero3-loss"] == pytest.approx(reference["loss"], rel=1e-5)
            assert results[f"{family}/zero3-weights-equal"], family


GPT2_LIKE = GPTConfig(n_layer=2, n_head=6, d_model=48, seq_len=16, vocab_size=1001)


@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE], ids=FAMILIES)
def test_export_round_trip(config: GPTConfig, tmp_path: Path) -> None:
    """ours -> folder -> from_pretrained gives our logits; and back to ours bit for bit."""
    model = GPT(config, seed=3).eval()
    full = {name: p.detach() for name, p in model.named_parameters()}
    write_hf_folder(tmp_path, full, config)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = GPT2LMHeadModel if config.norm == "layernorm" else LlamaForCausalLM
    assert type(hf) is expected and hf.dtype == torch.float32
    ids = hf_cases.tokens(2, 16)
    with torch.no_grad():
        assert_relative(hf(ids).logits, model(ids), 1e-5, "exported logits")
    again, weights = read_hf_folder(tmp_path)
    assert again == config
    assert weights.keys() == full.keys()
    assert all(torch.equal(weights[name], full[name]) for name in full)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_is_a_bijection(family: str) -> None:
    hf = hf_cases.make_hf(family, seed=1)
    config = config_from_hf(hf.config)
    state = {
        k: v
        for k, v in hf.state_dict().items()
        if not (config.tie_embeddings and k == "lm_head.weight")
    }
    back, _ = ours_to_hf(hf_to_ours(state, config), config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path: Path, checkpoints: dict) -> None:
    folder, reference = checkpoints["llama"]
    state = read_hf_weights(folder)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    torch.save(state, tmp_path / "pytorch_model.bin")
    config, weights = read_hf_folder(tmp_path)
    logits = hf_cases.ours(GPT(config, init_weights=weights).eval())["logits"]
    assert_relative(logits, reference["logits"], 1e-5, "logits from pytorch_model.bin")

    # A pickle that would run code when unpickled is refused, and nothing runs.
    hf_cases.UNPICKLED.clear()
    torch.save({"x": hf_cases.Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin.*weights_only=True"):
        read_hf_folder(tmp_path)
    assert not hf_cases.UNPICKLED
    # A safetensors file wins over pytorch_model.bin: the pickle is not even opened.
    save_file(read_hf_weights(folder), str(tmp_path / "model.safetensors"))
    assert read_hf_folder(tmp_path)[1].keys() == weights.keys()


def test_sharded_safetensors(tmp_path: Path) -> None:
    model = hf_cases.make_hf("gpt2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, weights = read_hf_folder(tmp_path)
    assert_relative(
        hf_cases.ours(GPT(config, init_weights=weights).eval())["logits"],
        hf_cases.hf_reference(model)["logits"],
        1e-5,
        "logits from shards",
    )


def test_missing_or_corrupt_files_are_named(tmp_path: Path, checkpoints: dict) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere: not a folder"):
        read_hf_folder(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        read_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text((checkpoints["gpt2"][0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights; expected model.safetensors"):
        read_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors"):
        read_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a readable Hugging Face config"):
        read_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text((checkpoints["gpt2"][0] / "config.json").read_text())
    index = {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        read_hf_folder(tmp_path)


def test_unsupported_options_are_named() -> None:
    scaled = LlamaConfig.from_dict(
        {"hidden_size": 48, "num_attention_heads": 6, "vocab_size": 100,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )  # fmt: skip
    with pytest.raises(ValueError, match="rope scaling 'linear'"):
        config_from_hf(scaled)
    biased = LlamaConfig.from_dict(
        {"hidden_size": 48, "num_attention_heads": 6, "attention_bias": True}
    )
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(biased)
    mixed = GPTConfig(n_layer=1, n_head=2, d_model=8, vocab_size=10, norm="rmsnorm")
    with pytest.raises(ValueError, match="no Hugging Face class matches"):
        ours_to_hf({}, mixed)
    hf = hf_cases.make_hf("gpt2")
    state = hf.state_dict() | {"transformer.h.0.attn.extra": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"no place in the model: \['h.0.attn.extra'\]"):
        hf_to_ours(state, config_from_hf(hf.config))


def test_meta_model_materialises_imported_slices() -> None:
    """On the meta device nothing is copied; initial_value slices the imported tensors
    for this TP rank (what the Engine calls), vocabulary padding included."""
    weights = {n: p.detach() for n, p in GPT(LLAMA_LIKE, seed=5).named_parameters()}
    for rank in range(3):
        tp = TensorParallel(
            VirtualGroup("tp", 3, rank), False, TPRandom(0, rank, torch.device("cpu"))
        )
        model = GPT(LLAMA_LIKE, tp, device="meta", init_weights=weights)
        specs = parameter_shards(model)
        assert specs["lm_head.weight"].logical_size == 1001
        for name, param in model.named_parameters():
            assert param.device.type == "meta"
            value = model.initial_value(name)
            assert value.shape == param.shape
            assert torch.equal(value, local_slice(weights[name], specs.get(name), rank)), name
    with pytest.raises(ValueError, match="imported weight wte.weight has shape"):
        GPT(LLAMA_LIKE, init_weights=weights | {"wte.weight": torch.zeros(1000, 48)})
    with pytest.raises(ValueError, match=r"missing \['ln_f.weight'\]"):
        GPT(LLAMA_LIKE, init_weights={k: v for k, v in weights.items() if k != "ln_f.weight"})
