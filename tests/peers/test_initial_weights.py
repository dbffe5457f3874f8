"""The benchmark's cached initial weights (benchmarks/compare/initial_weights.py) are the
seeded draw itself: read back bit for bit, drawn afresh when what decides them changes,
and never read from a damaged file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` imports

from benchmarks.compare import initial_weights
from models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, seq_len=8)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(initial_weights, "CACHE", tmp_path)
    return tmp_path


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_cached_read_is_the_seeded_draw(cache: Path) -> None:
    drawn = {k: v.clone() for k, v in GPT(CONFIG, seed=7).state_dict().items()}
    first = initial_weights.seeded_weights(CONFIG, 7)
    assert len(list(cache.glob("*.pt"))) == 1 and not list(cache.glob("*.partial"))
    second = initial_weights.seeded_weights(CONFIG, 7)  # from the file
    assert _equal(first, drawn) and _equal(second, drawn)
    # Another seed or shape is another file, with other values.
    other = initial_weights.seeded_weights(CONFIG, 8)
    assert len(list(cache.glob("*.pt"))) == 2 and not _equal(other, drawn)


def test_the_key_follows_the_drawing_code(
    cache: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = initial_weights.weights_key(CONFIG, 7)
    source = tmp_path_factory.mktemp("src")
    (source / "init.py").write_text("STD = 0.02\n")
    monkeypatch.setattr(initial_weights, "ROOT", source.parent)
    monkeypatch.setattr(initial_weights, "SOURCES", [source])
    edited = initial_weights.weights_key(CONFIG, 7)
    (source / "init.py").write_text("STD = 0.03\n")
    assert edited != before and initial_weights.weights_key(CONFIG, 7) != edited


def test_a_truncated_file_is_drawn_again(cache: Path) -> None:
    drawn = initial_weights.seeded_weights(CONFIG, 7)
    (path,) = cache.glob("*.pt")
    path.write_bytes(path.read_bytes()[:100])
    assert _equal(initial_weights.seeded_weights(CONFIG, 7), drawn)
    assert torch.load(path, weights_only=True).keys() == drawn.keys()  # rewritten whole
