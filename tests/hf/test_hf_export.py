"""The streamed Hugging Face export (models.gpt.hf.export) against transformers' own
save_pretrained (the same files, index and tensors) and from_pretrained (the same logits
as ours), for GPT-2 and Llama with grouped-query attention."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import hf_cases
import pytest
import torch
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from models.gpt import GPT
from models.gpt.hf.export import parse_shard_size, source_order, write_hf_export
from models.gpt.hf.folder import read_hf_folder

FAMILIES = ("gpt2", "llama")
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """family -> (a random transformers model, its save_pretrained folder)."""
    out = {}
    for family in FAMILIES:
        model = hf_cases.make_hf(family, seed=11)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = (model, folder)
    return out


def ours_stream(folder: Path) -> tuple:
    config, weights = read_hf_folder(folder)
    names = source_order(config)
    layout = [(n, tuple(weights[n].shape), weights[n].dtype) for n in names]
    return config, weights, layout, ((n, weights[n]) for n in names)


def files(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(f) for f in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("family", FAMILIES)
def test_shards_and_index_equal_save_pretrained(models: dict, family: str, tmp_path: Path) -> None:
    """With no tensor above the limit, the same files as save_pretrained(max_shard_size),
    each holding the same tensors, and the same index; from_pretrained loads it and its
    logits are ours (1e-5, fp32)."""
    model, folder = models[family]
    reference = tmp_path / "reference"
    model.save_pretrained(reference, max_shard_size="200KB")  # every tensor is smaller
    config, weights, layout, stream = ours_stream(folder)
    out = write_hf_export(tmp_path / "ours", config, layout, stream, max_shard_size="200KB")
    expected, got = files(reference), files(out)
    assert len(expected) > 2 and expected.keys() == got.keys()
    for name, tensors in expected.items():
        assert tensors.keys() == got[name].keys(), name
        for key, tensor in tensors.items():
            assert torch.equal(got[name][key], tensor), key
    assert json.loads((out / INDEX).read_text()) == json.loads((reference / INDEX).read_text())

    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(model)
    ids = hf_cases.tokens()[:, :-1]
    with torch.no_grad():
        theirs = back(ids).logits
        ours = GPT(config, init_weights=weights).eval()(ids)
    assert ((theirs - ours).norm() / ours.norm()).item() < 1e-5


def test_a_tensor_above_the_limit_gets_its_own_file(models: dict, tmp_path: Path) -> None:
    """At 80KB the (1001 x 48) bf16 embeddings exceed the limit: each alone in a file, every
    other file within the limit, every tensor listed once, total_size the bytes on disk;
    bf16 on request, and from_pretrained still loads it."""
    model, folder = models["llama"]
    config, _, layout, stream = ours_stream(folder)
    limit = 80_000
    out = write_hf_export(tmp_path / "o", config, layout, stream, limit, torch.bfloat16)
    index = json.loads((out / INDEX).read_text())
    shards = files(out)
    listed = [key for tensors in shards.values() for key in tensors]
    assert sorted(listed) == sorted(index["weight_map"]) == sorted(model.state_dict())
    assert all(index["weight_map"][key] == name for name, t in shards.items() for key in t)
    sizes = {name: sum(t.nbytes for t in ts.values()) for name, ts in shards.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for name, tensors in shards.items():
        assert sizes[name] <= limit or len(tensors) == 1, name
    big = [n for n, ts in shards.items() if len(ts) == 1 and sizes[n] > limit]
    assert len(big) == 2  # embed_tokens and lm_head
    state = model.state_dict()
    for tensors in shards.values():
        for key, tensor in tensors.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[key].bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_one_file_and_no_index_when_everything_fits(models: dict, tmp_path: Path) -> None:
    model, folder = models["gpt2"]
    config, _, layout, stream = ours_stream(folder)
    out = write_hf_export(tmp_path / "o", config, layout, stream)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(out / "model.safetensors").keys() == model.state_dict().keys() - {
        "lm_head.weight"  # tied: left out, as save_pretrained leaves it out
    }


def test_a_failed_export_leaves_the_previous_folder(models: dict, tmp_path: Path) -> None:
    """A stream that breaks half way: nothing under the final name changes."""
    _, folder = models["gpt2"]
    config, weights, layout, stream = ours_stream(folder)
    out = write_hf_export(tmp_path / "o", config, layout, stream, "100KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def breaking() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, _, _) in enumerate(layout):
            if i == len(layout) // 2:
                raise OSError("disk full")
            yield name, weights[name] * 2

    with pytest.raises(OSError, match="disk full"):
        write_hf_export(out, config, layout, breaking(), "100KB")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_shard_sizes_parse_as_huggingface_hub_parses_them() -> None:
    for text in ("5GB", "500MB", "1.5GB", "10KB", "2TB", " 3gb "):
        assert parse_shard_size(text) == parse_size_to_int(text), text
    assert parse_shard_size(123) == parse_shard_size("123") == 123
    for bad in ("5 gigs", "GB", "-1MB", "0", ""):
        with pytest.raises(ValueError, match="max shard size") as error:
            parse_shard_size(bad)
        assert "\n" not in str(error.value)
