"""Pre-tokenized inputs: our token-shard folders and local Hugging Face datasets folders.

The reference for every read is the plain computation: np.concatenate of the arrays that
were written, and the in-memory list the datasets folder was made from.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from launch.data.hf_folders import is_hf_folder, open_hf_folder
from launch.data.sampler import TokenWindows
from launch.data.shards import TokenShards, is_token_shards, write_token_shards

DOCS = ["First document.", None, "Second one, a little longer.", "", "Third."]
IDS = [[5, 6, 7], [8], [], [9, 10, 11, 12]]


def _docs(seed: int, n: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 40)) for _ in range(n)]


@pytest.mark.parametrize("dtype,vocab", [("uint16", 50257), ("uint32", 100_000)])
def test_round_trip_across_shard_boundaries(dtype: str, vocab: int, tmp_path: Path) -> None:
    docs = _docs(0, 60, vocab)
    reference = np.concatenate(docs)
    write_token_shards(tmp_path / "s", iter(docs), dtype, vocab, tokens_per_shard=53)
    tokens = TokenShards(tmp_path / "s", tokenizer_size=vocab)
    assert is_token_shards(tmp_path / "s") and len(tokens.shards) > 10
    assert len(tokens) == len(reference) and tokens.dtype == np.dtype(dtype)
    for a in range(0, len(reference), 13):
        for b in range(a, len(reference) + 1, 29):
            assert np.array_equal(np.asarray(tokens[a:b]), reference[a:b]), (a, b)
    view = tokens[100:-50]  # a view of a view, negative bounds, as prepare_data's split
    assert np.array_equal(np.asarray(view[7:300], dtype=np.int64), reference[107:400])
    assert (
        tokens[-1] == reference[-1]
        and tokens[len(reference) // 2] == reference[len(reference) // 2]
    )
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    assert np.array_equal(tokens.document_starts(), starts)
    windows = TokenWindows(tokens, 16)  # what training slices: windows across boundaries
    ids = np.arange(len(windows))
    rows = np.stack([reference[i * 16 : i * 16 + 17] for i in ids])
    assert np.array_equal(windows.batch(ids).numpy(), rows)
    again = pickle.loads(pickle.dumps(view))  # to a worker: the folder travels, not the data
    assert len(pickle.dumps(view)) < 10_000 and np.array_equal(np.asarray(again), np.asarray(view))


def _raw_shard(folder: Path, tokens: list[int], vocab: int, **manifest: object) -> Path:
    """A folder written by hand, as another tool would: our writer refuses bad ids."""
    folder.mkdir(parents=True)
    data = np.asarray(tokens, "<u2").tobytes()
    (folder / "a.bin").write_bytes(data)
    shard = {"file": "a.bin", "n_tokens": len(tokens), "xxh3": xxhash.xxh3_64_hexdigest(data)}
    body = {"format": "hybrid-token-shards/1", "dtype": "uint16", "vocab_size": vocab}
    (folder / "manifest.json").write_text(json.dumps({**body, "shards": [shard], **manifest}))
    return folder


def test_bad_shard_folders_say_what_is_wrong(tmp_path: Path) -> None:
    def error(folder: Path, **options: object) -> str:
        with pytest.raises(ValueError) as caught:
            TokenShards(folder, **options)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    bad_id = _raw_shard(tmp_path / "bad_id", [1, 2, 3, 500, 4], vocab=500)  # id == vocab_size
    assert "a.bin: token id 500 at offset 3 is outside the vocabulary [0, 500)" in error(bad_id)

    missing = tmp_path / "missing"
    write_token_shards(missing, _docs(1, 20, 100), "uint16", 100, tokens_per_shard=50)
    (missing / "shard-00001.bin").unlink()
    assert error(missing) == (
        f"{missing / 'manifest.json'} names shard shard-00001.bin, which is missing"
    )

    unreadable = _raw_shard(tmp_path / "unreadable", [1], vocab=10)
    (unreadable / "manifest.json").write_text('{"format": "hybrid-token-shards/1", "dty')
    assert "manifest.json is unreadable (" in error(unreadable)
    foreign = _raw_shard(tmp_path / "foreign", [1], vocab=10, format="other/2")
    assert "format is 'other/2', not 'hybrid-token-shards/1'" in error(foreign)
    assert "no manifest.json" in error(tmp_path / "nowhere")

    empty = _raw_shard(tmp_path / "empty", [], vocab=10)
    assert "lists no tokens; it is an empty source" in error(empty)
    with pytest.raises(ValueError, match="the arrays hold no tokens"):
        write_token_shards(tmp_path / "none", [np.zeros(0, np.int64)], "uint16", 10)

    small = _raw_shard(tmp_path / "small", [1, 2], vocab=600)
    assert "vocab_size 600 exceeds the tokenizer's 500 ids" in error(small, tokenizer_size=500)
    (small / "a.bin").write_bytes(np.asarray([1, 3], "<u2").tobytes())  # same size, changed
    assert "a.bin does not match its xxh3" in error(small)
    (small / "a.bin").write_bytes(b"\0")
    assert "1 bytes, but the manifest says 2 uint16 tokens (4 bytes)" in error(small)

    with pytest.raises(ValueError, match=r"array 1, offset 2: token id 10 is outside"):
        write_token_shards(tmp_path / "w", [np.arange(3), np.array([1, 2, 10])], "uint16", 10)


def test_the_full_scan_runs_once_per_unchanged_folder(tmp_path: Path, monkeypatch) -> None:
    write_token_shards(tmp_path / "s", _docs(2, 30, 1000), "uint16", 1000, tokens_per_shard=64)
    scans: list[Path] = []
    real_scan = TokenShards._scan
    monkeypatch.setattr(TokenShards, "_scan", lambda self: (scans.append(1), real_scan(self)))
    TokenShards(tmp_path / "s", stamp_dir=tmp_path / "cache")
    TokenShards(tmp_path / "s", stamp_dir=tmp_path / "cache")
    assert len(scans) == 1
    TokenShards(tmp_path / "s")  # no stamp folder (data.verify=full): scans every time
    assert len(scans) == 2
    shard = tmp_path / "s" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0:2] = np.asarray([60000], "<u2").tobytes()  # corrupt after the stamp was written
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="token id 60000 at offset 0"):
        TokenShards(tmp_path / "s", stamp_dir=tmp_path / "cache")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def test_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """200 MB of shards: writing, opening (with the full scan) and slicing across a
    boundary grow this process's peak RSS by the slice and a few MB, not the corpus."""
    try:
        _reset_peak()
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here")
    n_docs, doc = 100, 1_000_000
    chunk = (np.arange(doc, dtype=np.int64) * 7919) % 50257
    begin = time.perf_counter()
    base = _status_kb("VmRSS")
    write_token_shards(
        tmp_path / "big", ((chunk + i) % 50257 for i in range(n_docs)), "uint16", 50257,
        tokens_per_shard=30_000_000,
    )  # fmt: skip
    write_growth = _status_kb("VmHWM") - base
    TokenWindows(np.arange(40), 8).batch(np.arange(2))  # torch's one-time set-up, not ours
    _reset_peak()
    base = _status_kb("VmRSS")
    tokens = TokenShards(tmp_path / "big", tokenizer_size=50257)
    boundary = 30_000_000
    part = np.asarray(tokens[boundary - 500_000 : boundary + 500_000])  # 2 MB across shards 0|1
    read_growth = _status_kb("VmHWM") - base
    # Windows: their mapped file pages are page cache, shared by the ranks (and mapped a
    # whole large folio at a time by recent kernels), so the private memory is measured.
    anon = _status_kb("RssAnon")
    windows = TokenWindows(tokens[: 90 * doc], 1024)
    batch = windows.batch(np.arange(0, len(windows), len(windows) // 16))
    windows_growth = _status_kb("RssAnon") - anon
    # The reference: document i holds (chunk + i) % vocab, so positions are computable.
    position = np.arange(boundary - 500_000, boundary + 500_000)
    assert np.array_equal(part, (chunk[position % doc] + position // doc) % 50257)
    assert len(tokens) == n_docs * doc and batch.shape == (17, 1025)
    assert write_growth < 40_000, f"writing 200 MB grew peak RSS by {write_growth} kB"
    limit = part.nbytes // 1024 + 12_000
    assert read_growth < limit, f"open (full scan) + a 2 MB slice grew peak RSS by {read_growth} kB"
    assert windows_growth < 4_000, f"17 windows grew private RSS by {windows_growth} kB"
    assert time.perf_counter() - begin < 15


def _save(kind: str, folder: Path, columns: dict[str, list]) -> Path:
    import datasets

    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict(columns)
    if kind == "parquet":  # two files, as a dataset repository's data/ folder holds them
        (folder / "data").mkdir(parents=True)
        half = len(table) // 2
        table.select(range(half)).to_parquet(str(folder / "data" / "train-0.parquet"))
        table.select(range(half, len(table))).to_parquet(str(folder / "data" / "train-1.parquet"))
    elif kind == "arrow":
        table.save_to_disk(str(folder), num_shards=2)
    else:
        datasets.DatasetDict({"test": table.select([0]), "train": table}).save_to_disk(str(folder))
    return folder


@pytest.mark.parametrize("kind", ["parquet", "arrow", "dict"])
def test_datasets_folders_read_back_the_documents(kind: str, tmp_path: Path) -> None:
    text = open_hf_folder(_save(kind, tmp_path / "text", {"text": DOCS, "n": list(range(5))}))
    assert is_hf_folder(text.path) and not text.pretokenized and text.n_rows == len(DOCS)
    assert list(text.documents()) == [d for d in DOCS if d is not None]

    tokens = open_hf_folder(_save(kind, tmp_path / "ids", {"input_ids": IDS}), "text")
    assert tokens.pretokenized
    read = list(tokens.documents())
    assert [d.tolist() for d in read] == IDS and all(d.dtype == np.int64 for d in read)
    # input_ids -> our shards, as preparation would store them (empty rows kept as documents)
    write_token_shards(tmp_path / "shards", tokens.documents(), "uint16", 50257, 3)
    shards = TokenShards(tmp_path / "shards", tokenizer_size=50257)
    assert shards.tolist() == [t for ids in IDS for t in ids] and len(
        shards.document_starts()
    ) == len(IDS)


def test_bad_datasets_folders_say_what_is_wrong(tmp_path: Path) -> None:
    def error(folder: Path) -> str:
        with pytest.raises(ValueError) as caught:
            open_hf_folder(folder)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    (tmp_path / "nothing").mkdir()
    assert "holds no parquet files and no save_to_disk dataset" in error(tmp_path / "nothing")
    empty = _save("parquet", tmp_path / "empty", {"text": []})
    assert error(empty) == f"{empty} holds no documents (0 rows); it is an empty source"
    other = _save("arrow", tmp_path / "other", {"body": ["a", "b"]})
    assert "has neither a 'text' nor an 'input_ids' column (columns: body)" in error(other)
    (other / "data-00001-of-00002.arrow").unlink()
    assert "state.json names data-00001-of-00002.arrow, which is missing" in error(other)


def test_pretraining_reads_a_shard_folder_in_place_and_names_a_missing_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.files=[<shard folder>]: a run trains on the shards (no tokenizing, nothing
    copied into the cache); an id outside the vocabulary, or a shard gone, is one error
    line before any process group."""
    from small_run import TINY_CONFIG, small_run_overrides

    from launch import pretrain
    from launch.config import ConfigError, load_config
    from launch.train.entry import check_before_start

    folder = tmp_path / "shards"
    ids = np.random.default_rng(0).integers(0, 50257, size=6000)
    write_token_shards(folder, [ids[:2500], ids[2500:]], vocab_size=50257, tokens_per_shard=4000)
    overrides = small_run_overrides(folder, tmp_path / "cache", tmp_path / "run")
    overrides += ["data.tokenizer=gpt2", "train.steps=2", "sample.tokens=0"]
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0
    assert "5,700 train tokens" in capsys.readouterr().out  # 95% of the 6000 shard tokens
    assert not (tmp_path / "cache" / "tokens").exists()
    write_token_shards(tmp_path / "bad", [ids], vocab_size=50257, tokens_per_shard=4000)
    with open(tmp_path / "bad" / "shard-00000.bin", "r+b") as f:  # a folder never scanned
        f.seek(3000 * 2)
        f.write(np.uint16(50257).tobytes())  # an id outside the vocabulary
    bad_run = small_run_overrides(tmp_path / "bad", tmp_path / "cache", tmp_path / "run2")
    with pytest.raises(ConfigError, match=r"token id 50257 at offset 3000 is outside"):
        check_before_start(load_config(str(TINY_CONFIG), [*bad_run, *overrides[-3:]]), 1)
    (folder / "shard-00001.bin").unlink()
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("names shard shard-00001.bin, which is missing") and "\n" not in err
