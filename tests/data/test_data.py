"""Data pipeline: local text/jsonl/parquet -> cached token file; deterministic resumable batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.config import DataConfig
from launch.data import DistributedBatches, TokenWindows, eval_batches, prepare_data
from launch.data.token_file import build_token_file, resolve_files
from launch.data.tokenizers import gpt2_tokenizer

DOCS = ["First document.", "Second one, a little longer.", "Third."]


def _write_inputs(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "docs.txt"
    text.write_text("\n\n".join(DOCS) + "\n")
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    parquet = folder / "docs.parquet"
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(parquet))
    return {"text": text, "jsonl": jsonl, "parquet": parquet}


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_token_file_from_each_format(kind: str, tmp_path: Path) -> None:
    path = _write_inputs(tmp_path / "in")[kind]
    tokenizer = gpt2_tokenizer()
    token_file = build_token_file([path], tokenizer, "text", tmp_path / "cache")
    tokens = token_file.open()
    assert token_file.dtype == np.uint16  # 50257 ids fit in 16 bits
    eos = tokenizer.eos_token_id
    decoded = tokenizer.decode(tokens.tolist())
    if kind == "text":  # paragraphs keep their blank lines; one EOS ends the file
        assert decoded == "\n\n".join(DOCS) + "\n\n" + "<|endoftext|>"
    else:  # one EOS after each record
        assert decoded == "".join(d + "<|endoftext|>" for d in DOCS)
        assert int((tokens == eos).sum()) == len(DOCS)


def test_token_file_is_cached_by_content(tmp_path: Path) -> None:
    path = _write_inputs(tmp_path / "in")["jsonl"]
    tokenizer = gpt2_tokenizer()
    first = build_token_file([path], tokenizer, "text", tmp_path / "cache")
    mtime = first.path.stat().st_mtime_ns
    again = build_token_file([path], tokenizer, "text", tmp_path / "cache")
    assert again.path == first.path and again.path.stat().st_mtime_ns == mtime
    path.write_text(json.dumps({"text": "changed"}) + "\n")
    changed = build_token_file([path], tokenizer, "text", tmp_path / "cache")
    assert changed.path != first.path


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        resolve_files([str(tmp_path / "nope.txt")])
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        resolve_files([str(odd)])
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(ValueError, match="has no 'text' field .*body.*data.text_field"):
        build_token_file([jsonl], gpt2_tokenizer(), "text", tmp_path / "cache")


def test_bundled_corpus_split(cache_dir: Path) -> None:
    data = prepare_data(DataConfig(tokenizer="gpt2", cache_dir=str(cache_dir)))
    total = len(data.train_tokens) + len(data.val_tokens)
    assert total > 1_000_000  # about 4.8M characters of Shakespeare
    assert len(data.val_tokens) == total - int(total * 0.95)
    assert data.tokenizer.decode(data.train_tokens[:3].tolist()).startswith("THESEUS")


def _batches(tokens: np.ndarray, dp_rank: int, dp: int, start: int = 0) -> DistributedBatches:
    return DistributedBatches(
        TokenWindows(tokens, 8),
        seed=7,
        global_batch_size=8,
        micro_batch_size=2,
        dp_rank=dp_rank,
        dp_size=dp,
        start_sample=start,
    )


def test_windows_are_inputs_and_shifted_targets() -> None:
    tokens = np.arange(100, dtype=np.uint16)
    windows = TokenWindows(tokens, 8)
    assert len(windows) == 12  # (100 - 1) // 8
    batch = windows.batch(np.array([0, 3]))
    assert batch.dtype == torch.int64 and batch.shape == (2, 9)
    assert batch[1].tolist() == list(range(24, 33))


def test_sampler_deterministic_and_epoch_complete() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = _batches(tokens, 0, 1), _batches(tokens, 0, 1)
    steps_a = [torch.cat(a.next_step()) for _ in range(6)]
    steps_b = [torch.cat(b.next_step()) for _ in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(steps_a, steps_b, strict=True))
    # 124 windows; the first 15 steps (120 samples) are all distinct windows of one epoch.
    c = _batches(tokens, 0, 1)
    starts = torch.cat([torch.cat(c.next_step())[:, 0] for _ in range(15)])
    assert len(set(starts.tolist())) == 120
    assert c.consumed_samples == 120


def test_sampler_resumes_from_global_sample_index() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    full = _batches(tokens, 0, 1)
    steps = [torch.cat(full.next_step()) for _ in range(20)]  # crosses an epoch boundary
    resumed = _batches(tokens, 0, 1, start=8 * 13)
    for step in steps[13:]:
        assert torch.equal(torch.cat(resumed.next_step()), step)


def test_ranks_together_see_the_single_process_batch() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    single = _batches(tokens, 0, 1, start=40)
    ranks = [_batches(tokens, r, 2, start=40) for r in range(2)]
    for _ in range(5):
        expected = torch.cat(single.next_step())
        per_rank = [rank.next_step() for rank in ranks]
        assert all(len(mbs) == 2 and mbs[0].shape == (2, 9) for mbs in per_rank)
        assert torch.equal(torch.cat([torch.cat(mbs) for mbs in per_rank]), expected)


def test_eval_set_is_fixed_and_split_without_overlap() -> None:
    windows = TokenWindows(np.arange(200, dtype=np.uint16), 8)
    parts = [eval_batches(windows, 10, 2, r, 2) for r in range(2)]
    starts = sorted(int(b[i, 0]) for part in parts for b in part for i in range(len(b)))
    assert starts == [8 * i for i in range(10)]


@pytest.mark.parametrize("damage", ["altered", "truncated", "meta"])
def test_a_corrupt_token_cache_is_rebuilt(damage: str, tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n\n" * 50)
    built = build_token_file([corpus], gpt2_tokenizer(), "text", tmp_path / "cache")
    good = np.array(built.open())
    data = bytearray(built.path.read_bytes())
    if damage == "altered":  # same size, one token changed
        data[10] ^= 0xFF
        built.path.write_bytes(bytes(data))
    elif damage == "truncated":
        built.path.write_bytes(bytes(data[:-6]))
    else:
        (built.path.parent / "meta.json").write_text("{not json")
    with pytest.warns(UserWarning, match="is corrupt: .*rebuilding it"):
        again = build_token_file([corpus], gpt2_tokenizer(), "text", tmp_path / "cache")
    assert np.array_equal(np.array(again.open()), good)


def test_a_malformed_jsonl_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "thr\n{"text": "four"}\n')
    with pytest.raises(ValueError, match=f"{path}:3: not valid JSON"):
        build_token_file([path], gpt2_tokenizer(), "text", tmp_path / "cache")
    path.write_text('{"text": "one"}\n["a", "list"]\n')
    with pytest.raises(ValueError, match=f"{path}:2: a record must be a JSON object"):
        build_token_file([path], gpt2_tokenizer(), "text", tmp_path / "cache")
