"""Mixtures of corpora by weight (launch.data.mixture): proportions, resume at any dp,
one validation loss per source, and the bad inputs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from small_run import TINY_CONFIG, small_run_overrides

from hybrid.distributed.env import init_distributed, shutdown, world_size_from_env
from hybrid.instruments.local_processes import run_processes
from launch.config import DataConfig, MixtureSource, load_config, validate_layout
from launch.data import DistributedBatches, TokenWindows, load_tokenizer, prepare_data
from launch.data.mixture import (
    MixtureWindows,
    block_counts,
    check_sources,
    load_mixture,
    source_names,
    validation_sets,
)
from launch.train.loop import train

SEQ = 8
OFFSET = 10_000  # source B's tokens: its windows are told apart by their values


def _windows(n_a: int = 500, n_b: int = 300, weights: tuple = (0.7, 0.3)) -> MixtureWindows:
    a = TokenWindows(np.arange(n_a * SEQ + 1, dtype=np.int64), SEQ)
    b = TokenWindows(OFFSET + np.arange(n_b * SEQ + 1, dtype=np.int64), SEQ)
    return MixtureWindows([a, b], list(weights), ["a", "b"])


def _batches(mixture: MixtureWindows, rank: int, dp: int, start: int = 0) -> DistributedBatches:
    return DistributedBatches(mixture, 11, 16, 2, rank, dp, start_sample=start)


def test_block_counts_are_the_largest_remainder_shares() -> None:
    assert block_counts([0.7, 0.3]).tolist() == [717, 307]  # 716.8, 307.2
    assert block_counts([1, 1, 1]).tolist() == [342, 341, 341]
    assert block_counts([0, 2]).tolist() == [0, 1024]
    for weights in ([0.001, 0.999], [3, 1, 0, 5], [0.2] * 7):
        counts = block_counts(weights)
        quota = np.asarray(weights) / sum(weights) * 1024
        assert counts.sum() == 1024 and np.all(np.abs(counts - quota) < 1), counts


def test_proportions_over_ten_thousand_windows_match_the_weights() -> None:
    mixture = _windows()
    batches = _batches(mixture, 0, 1)
    rows = torch.cat([torch.cat(batches.next_step()) for _ in range(625)])  # 10,000 windows
    from_b = (rows[:, 0] >= OFFSET).numpy()
    assert len(rows) == 10_000
    assert abs(from_b.mean() - 0.3) < 0.01 and abs((~from_b).mean() - 0.7) < 0.01
    # Each source walks its own epochs: its first len(source) windows are each of its
    # windows once (a never repeats within 500 draws, b within 300).
    a_starts = rows[~from_b, 0].numpy()[:500] // SEQ
    b_starts = (rows[from_b, 0].numpy()[:300] - OFFSET) // SEQ
    assert np.array_equal(np.sort(a_starts), np.arange(500))
    assert np.array_equal(np.sort(b_starts), np.arange(300))
    # ... and epochs follow one another: after K draws, each window came K // n or K // n + 1
    # times.
    for starts in [rows[~from_b, 0].numpy() // SEQ, (rows[from_b, 0].numpy() - OFFSET) // SEQ]:
        times = np.bincount(starts)
        assert times.max() - times.min() <= 1, times
    # Every window holds consecutive tokens of one source (ids map to the right source).
    assert torch.equal(rows[:, 1:] - rows[:, :-1], torch.ones(10_000, SEQ, dtype=torch.int64))


def test_resume_mid_run_and_at_another_dp_gives_the_same_windows() -> None:
    mixture = _windows()
    straight = _batches(mixture, 0, 1)
    steps = [torch.cat(straight.next_step()) for _ in range(90)]  # crosses a 1024-block
    for dp, stopped_at in [(1, 13), (2, 13), (4, 61), (2, 70)]:  # 70: in the 2nd block
        ranks = [_batches(_windows(), r, dp, start=16 * stopped_at) for r in range(dp)]
        for step in steps[stopped_at:]:
            resumed = torch.cat([torch.cat(rank.next_step()) for rank in ranks])
            assert torch.equal(resumed, step), (dp, stopped_at)


def test_a_zero_weight_source_is_never_drawn() -> None:
    rows = torch.cat([torch.cat(_batches(_windows(weights=(1.0, 0.0)), 0, 1).next_step())])
    assert (rows[:, 0] < OFFSET).all()
    batches = _batches(_windows(weights=(0.0, 2.0)), 0, 1)
    rows = torch.cat([torch.cat(batches.next_step()) for _ in range(70)])
    assert (rows[:, 0] >= OFFSET).all()


def test_source_names_are_stems_unless_they_clash() -> None:
    sources = [MixtureSource(["x/web.jsonl"]), MixtureSource(["y/books.txt", "z.txt"])]
    assert source_names(sources) == ["web", "books"]
    clash = [MixtureSource(["x/web.txt"]), MixtureSource(["y/web.txt"])]
    assert source_names(clash) == ["0-web", "1-web"]


def _corpus(folder: Path, small_corpus: Path) -> tuple[Path, Path]:
    text = small_corpus.read_text()
    folder.mkdir(parents=True, exist_ok=True)
    a, b = folder / "plays.txt", folder / "sonnets.txt"
    a.write_text(text[:60_000])
    b.write_text(text[100_000:130_000].upper())  # another distribution: a different loss
    return a, b


def test_each_source_has_its_own_cache_and_validation_set(
    small_corpus: Path, tmp_path: Path
) -> None:
    a, b = _corpus(tmp_path / "in", small_corpus)
    sources = [MixtureSource([str(a)], 0.7), MixtureSource([str(b)], 0.3)]
    data = DataConfig(mixture=sources, tokenizer="bpe", bpe_vocab_size=300)
    data.cache_dir = str(tmp_path / "cache")
    tokenizer, train_set, val_set, description = load_mixture(data, SEQ)
    assert "plays 70%" in description and "sonnets 30%" in description
    # One tokenizer, trained on both sources' files together.
    union = load_tokenizer(dataclasses.replace(data, files=[str(a), str(b)], mixture=[]))
    sample = b.read_text()[:2000] + a.read_text()[:2000]
    assert tokenizer.encode(sample) == union.encode(sample)
    for i, path in enumerate([a, b]):  # each source encoded with the shared tokenizer
        expected = union.encode(path.read_text()[:500])[:20]
        assert train_set.parts[i].tokens[:20].tolist() == expected
    # Each source's split is what prepare_data gives for its files alone (its own cache).
    data.tokenizer = "gpt2"
    _, train_set, val_set, _ = load_mixture(data, SEQ)
    for i, path in enumerate([a, b]):
        alone = prepare_data(dataclasses.replace(data, files=[str(path)], mixture=[]))
        assert np.array_equal(val_set.parts[i].tokens, alone.val_tokens)
        assert np.array_equal(train_set.parts[i].tokens, alone.train_tokens)
    keys = [key for key, _, _ in validation_sets(val_set, 6, 2, 0, 1)]
    assert keys == ["val_loss/plays", "val_loss/sonnets"]
    assert [len(b) for b in validation_sets(val_set, 6, 2, 1, 2)[1][2]] == [2, 1]


def test_an_empty_source_is_named(small_corpus: Path, tmp_path: Path) -> None:
    a, _ = _corpus(tmp_path, small_corpus)
    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text('{"text": ""}\n')
    data = DataConfig(tokenizer="gpt2", cache_dir=str(tmp_path / "cache"))
    data.mixture = [MixtureSource([str(a)], 0.5), MixtureSource([str(empty)], 0.5)]
    with pytest.raises(ValueError, match=rf"^data.mixture\[1\]: {re.escape(str(empty))} is empty"):
        check_sources(data)
    data.mixture[1] = MixtureSource([str(blank)], 0.5)
    with pytest.raises(ValueError, match=rf"^data.mixture\[1\] \({re.escape(str(blank))}\): "):
        load_mixture(data, SEQ)


def _mixture_and_alone(root: Path, a: Path, b: Path) -> dict[str, list[dict]]:
    """A mixture run and a run on each source alone, at lr 1e-30: the model stays at its
    initial weights, so each source's val_loss in the mixture must equal the loss of the
    plain single-corpus run on that source's files."""
    env = init_distributed()
    try:
        mixture = f"data.mixture=[{{files: [{a}], weight: 0.7}}, {{files: [{b}], weight: 0.3}}]"
        runs = {"mixture": [mixture], "a": [f"data.files=[{a}]"], "b": [f"data.files=[{b}]"]}
        history = {}
        for name, extra in runs.items():
            base = small_run_overrides(a, root / "cache", root / name)
            base = [o for o in base if not o.startswith("data.")] + [f"data.cache_dir={root}/c"]
            overrides = [*base, "data.tokenizer=gpt2", "train.lr=1e-30", "train.min_lr=0"]
            overrides += ["train.steps=1", "sample.tokens=0", *extra]
            config = load_config(TINY_CONFIG, overrides)
            history[name] = train(config, env, validate_layout(config, world_size_from_env()))
        return history
    finally:
        shutdown(env)


def test_a_mixture_run_writes_val_loss_per_source(small_corpus: Path, tmp_path: Path) -> None:
    a, b = _corpus(tmp_path / "in", small_corpus)
    ran = run_processes(_mixture_and_alone, 1, tmp_path, a, b)[0]
    rows = [json.loads(line) for line in (tmp_path / "mixture" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1]
    for row, alone_a, alone_b in zip(rows, ran["a"], ran["b"], strict=True):
        assert row["val_loss/plays"] == pytest.approx(alone_a["val_loss"], rel=1e-6)
        assert row["val_loss/sonnets"] == pytest.approx(alone_b["val_loss"], rel=1e-6)
        overall = 0.7 * row["val_loss/plays"] + 0.3 * row["val_loss/sonnets"]
        assert row["val_loss"] == pytest.approx(overall, rel=1e-12)
