"""Lazy Hugging Face import (models.gpt.hf.lazy): every rank reads only its piece.

- `read` equals the old eager path (hf_to_ours of the whole files, then local_slice) for
  every parameter, tp in (1, 2, 4), every rank and ranges that start and end mid-row and
  cover the vocabulary padding; from one file, an index and shards, shards without an
  index, pytorch_model.bin, and that bin converted to safetensors.
- A stage-3-sized range gets from the files (counted where safetensors hands slices out)
  at most the rows the range covers plus one either side, never a whole tensor.
- 2 gloo processes, at tp=2 and at dp=2 ZeRO-3: the Engine's shards from the lazy source
  equal those from the eager tensors, and gather back to the eager model.
- Bad input is one line naming the file and the key, raised by read_hf_config (headers
  only, before any process group).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hf_cases
import hf_lazy_cases
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybrid.distributed.comm import VirtualGroup
from hybrid.instruments.local_processes import run_processes
from hybrid.tensor_parallel import TensorParallel, TPRandom, parameter_shards
from hybrid.tensor_parallel.shards import local_shape, local_slice
from models.gpt import GPT
from models.gpt.hf import bin as hf_bin_module
from models.gpt.hf import lazy as hf_files_module
from models.gpt.hf.folder import hf_to_ours, read_hf_config, read_hf_weights
from models.gpt.hf.lazy import bin_to_safetensors, open_hf_weights

FAMILIES = ("gpt2", "llama")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """'<family>/<layout>' -> a checkpoint folder of the same random model."""
    out = {}
    for family in FAMILIES:
        model = hf_lazy_cases.make_hf(family)
        root = tmp_path_factory.mktemp(family)
        model.save_pretrained(root / "single")
        model.save_pretrained(root / "index", max_shard_size="60KB")
        assert len(list((root / "index").glob("model-*.safetensors"))) >= 3
        shutil.copytree(root / "index", root / "no-index")
        (root / "no-index" / "model.safetensors.index.json").unlink()
        (root / "bin").mkdir()
        shutil.copy(root / "single" / "config.json", root / "bin")
        # A tied GPT-2's state dict holds lm_head sharing wte's storage, as it would saved.
        torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
        (root / "bin" / "vocab.json").write_text("{}")  # stands for the tokenizer files
        bin_to_safetensors(root / "bin", root / "converted", shard_bytes=100_000)
        out |= {f"{family}/{p.name}": p for p in root.iterdir()}
    return out


def tp_model(config: object, tp: int, rank: int) -> GPT:
    group = TensorParallel(
        VirtualGroup("tp", tp, rank), False, TPRandom(0, rank, torch.device("cpu"))
    )
    return GPT(config, group, device="meta")  # type: ignore[arg-type]


def ranges(numel: int, cols: int) -> list[tuple[int, int]]:
    """Whole, mid-row to mid-row, a thin slice, the last rows (padding under a vocabulary
    split), one element, empty."""
    picks = [(0, numel), (1, numel - 1), (cols + 3, 3 * cols - 2), (numel // 3, numel // 2)]
    picks += [(max(0, numel - cols - 5), numel), (numel // 2, numel // 2 + 1), (7, 7)]
    return [(a, b) for a, b in picks if 0 <= a <= b <= numel]


LAYOUTS = ("single", "index", "no-index", "bin", "converted")


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_equal_the_eager_slices(
    folders: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = read_hf_config(folders[f"{family}/single"])
    eager = hf_to_ours(load_file(folders[f"{family}/single"] / "model.safetensors"), config)
    default = hf_files_module._MAPPED_BYTES
    for layout in LAYOUTS:
        # From the shards, files mapped 700 bytes at a time (1 to 5 rows): every run is
        # read in pieces; the rest with the default (one piece for these tiny tensors).
        mapped = 700 if layout == "index" else default
        monkeypatch.setattr(hf_files_module, "_MAPPED_BYTES", mapped)
        source = open_hf_weights(folders[f"{family}/{layout}"], config)
        assert sorted(source.names()) == sorted(eager)
        for tp in (1, 2, 4):
            for rank in range(tp):
                model = tp_model(config, tp, rank)
                specs = parameter_shards(model)
                if tp > 1:
                    assert specs["wte.weight"].logical_size % tp  # the split pads
                for name, param in model.named_parameters():
                    spec = specs.get(name)
                    assert source.shape(name) == tuple(eager[name].shape), name
                    assert source.dtype(name) == eager[name].dtype, name
                    expected = local_slice(eager[name], spec, rank).reshape(-1)
                    cols = param.shape[1] if param.dim() == 2 else 1
                    for start, end in ranges(param.numel(), cols):
                        got = source.read(name, spec, rank, start, end)
                        what = f"{layout} tp={tp} rank={rank} {name}[{start}:{end}]"
                        assert torch.equal(got, expected[start:end]), what


class SliceSpy:
    """What get_slice returns, counting the elements each indexing hands out."""

    def __init__(self, inner: object, key: str, log: list) -> None:
        self.inner, self.key, self.log = inner, key, log

    def __getitem__(self, index: object) -> torch.Tensor:
        tensor = self.inner[index]  # type: ignore[index]
        self.log.append((self.key, tensor.numel()))
        return tensor

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()  # type: ignore[attr-defined]

    def get_dtype(self) -> str:
        return self.inner.get_dtype()  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_range_reads_only_its_rows(
    folders: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of tp=2, the second quarter of each local slice (rank 1's shard at ZeRO-3
    dp=4): the files hand out at most (rows covering it + 2) x this rank's columns."""
    folder = folders[f"{family}/index"]
    config = read_hf_config(folder)
    source = open_hf_weights(folder, config)
    real_open = hf_files_module.safe_open
    log: list[tuple[str, int]] = []

    class OpenSpy:
        def __init__(self, path: str, framework: str) -> None:
            self.inner = real_open(path, framework=framework)

        def __enter__(self) -> OpenSpy:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def get_slice(self, key: str) -> SliceSpy:
            return SliceSpy(self.inner.get_slice(key), key, log)

    monkeypatch.setattr(hf_files_module, "safe_open", OpenSpy)
    model = tp_model(config, 2, 1)
    specs = parameter_shards(model)
    stored = {k: v.numel() for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    for name, param in model.named_parameters():
        spec = specs.get(name)
        local = local_shape(tuple(source.shape(name)), spec)
        cols = local[1] if len(local) == 2 else 1
        start, end = param.numel() // 4, param.numel() // 2
        log.clear()
        source.read(name, spec, 1, start, end)
        rows = -(-end // cols) - start // cols
        handed = sum(n for _, n in log)
        assert 0 < handed <= (rows + 2) * cols, (name, handed, rows, cols)
        for key, n in log:
            assert n < stored[key], f"{name}: the whole of {key}"


def test_engine_shards_equal_the_eager_path_at_tp2_and_zero3(folders: dict[str, Path]) -> None:
    ranks = run_processes(hf_lazy_cases.engine_shards, 2, str(folders["llama/index"]))
    for results in ranks:
        for layout in ("tp2", "dp2-zero3"):
            lazy, eager = results[f"{layout}/lazy"], results[f"{layout}/eager"]
            assert len(lazy) == len(eager) > 0
            assert all(torch.equal(a, b) for a, b in zip(lazy, eager, strict=True)), layout
            full = results[f"{layout}/full"]
            assert full.keys() == results["eager-full"].keys()
            for name, tensor in results["eager-full"].items():
                assert torch.equal(full[name], tensor), f"{layout} {name}"
    # The ranks hold different shards (so equality is not of the same data twice).
    assert not torch.equal(ranks[0]["dp2-zero3/lazy"][0], ranks[1]["dp2-zero3/lazy"][0])


def one_line_error(folder: Path, *parts: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        read_hf_config(folder)
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message


def rewrite(file: Path, change: dict) -> None:
    state = load_file(file)
    for key, tensor in change.items():
        if tensor is None:
            del state[key]
        else:
            state[key] = tensor
    save_file(state, str(file), metadata={"format": "pt"})


def test_bad_folders_are_one_line_naming_file_and_key(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def copy(name: str) -> Path:
        return Path(
            shutil.copytree(
                folders[name],
                tmp_path / f"{name.replace('/', '-')}-{len(list(tmp_path.iterdir()))}",
            )
        )

    shards = copy("llama/no-index")
    gone = sorted(shards.glob("model-*.safetensors"))[1]
    gone.unlink()
    one_line_error(shards, gone.name, "missing shard")

    indexed = copy("llama/index")
    gone = sorted(indexed.glob("model-*.safetensors"))[1]
    gone.unlink()
    one_line_error(indexed, "model.safetensors.index.json", f"names {gone.name}", "(for 'model.")

    key = "model.layers.1.self_attn.q_proj.weight"
    wrong = copy("llama/single")
    rewrite(wrong / "model.safetensors", {key: torch.zeros(56, 64)})
    one_line_error(wrong, "model.safetensors", key, "(56, 64)", "implies (64, 64)")
    rewrite(wrong / "model.safetensors", {key: None})
    one_line_error(wrong, "model.safetensors", key, "no tensor")

    extra = copy("llama/single")
    file = extra / "model.safetensors"
    rewrite(file, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)})
    read_hf_config(extra)  # a rotary buffer is not a parameter: skipped
    rewrite(file, {"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    one_line_error(extra, "model.safetensors", "'model.layers.0.mlp.extra.weight'", "no place")

    tied = copy("gpt2/single")  # a tied model's stored output layer and causal mask: skipped
    wte = load_file(tied / "model.safetensors")["transformer.wte.weight"]
    rewrite(
        tied / "model.safetensors",
        {"lm_head.weight": wte, "transformer.h.0.attn.bias": torch.ones(1, 1, 16, 16)},
    )
    read_hf_config(tied)

    other = copy("gpt2/single")
    (other / "config.json").write_text(json.dumps({"model_type": "gpt_neo"}))
    one_line_error(other, "config.json", "model_type 'gpt_neo' is not supported")

    pickled = copy("gpt2/bin")
    hf_cases.UNPICKLED.clear()
    torch.save({"x": hf_cases.Payload()}, pickled / "pytorch_model.bin")
    one_line_error(pickled, "pytorch_model.bin", "weights_only=True")
    assert not hf_cases.UNPICKLED  # refused before anything ran

    large = copy("gpt2/bin")
    monkeypatch.setattr(hf_bin_module, "BIN_LIMIT_BYTES", 1000)
    command = f"python -m launch.convert --bin-to-safetensors {large} --out <new folder>"
    one_line_error(large, "pytorch_model.bin", "GiB of pickled weights", command)


def test_converted_bin_loads_in_transformers(folders: dict[str, Path]) -> None:
    """The converted folder is sharded safetensors with an index and the other files;
    from_pretrained loads it to the original weights (tied GPT-2: shared storage)."""
    for family in FAMILIES:
        out = folders[f"{family}/converted"]
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "vocab.json", "model.safetensors.index.json"} <= names
        assert len([n for n in names if n.startswith("model-")]) >= 2
        original = torch.load(folders[f"{family}/bin"] / "pytorch_model.bin", weights_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in original.items())
        assert read_hf_weights(out).keys() == original.keys()
