"""Streaming corpus preparation (launch.data.prepare.corpus, launch.prepare_data): the tokens
equal a plain tokenization of the same documents, workers change nothing, a crash keeps
the finished inputs, the cache key and start-up check are cheap but catch what they
promise, and waiting ranks outlast the collective timeout."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from launch.data.prepare import corpus as prepare_module
from launch.data.prepare import read as prepare_read
from launch.data.prepare.corpus import prepare_corpus
from launch.data.token_file import build_token_file, token_folder
from launch.data.tokenizers import gpt2_tokenizer

DOCS = ["First document.\nIt has two lines.", "Second one, a little longer.", "Third é."]


class Crash(Exception):
    pass


def _inputs(folder: Path) -> list[Path]:
    """One file of each format, each holding DOCS (text: as paragraphs, some blank lines
    doubled)."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(DOCS) + "\n\n\n\n" + "\n\n".join(DOCS) + "\n"
    (folder / "a.txt").write_text(text)
    with gzip.open(folder / "b.txt.gz", "wt") as f:
        f.write(text)
    records = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    (folder / "c.jsonl").write_text(records + "\n" + records)
    datasets.Dataset.from_dict({"text": DOCS * 2}).to_parquet(str(folder / "d.parquet"))
    return [folder / n for n in ("a.txt", "b.txt.gz", "c.jsonl", "d.parquet")]


def _reference(paths: list[Path]) -> tuple[list[int], list[int]]:
    """The plain computation: datasets reads each file (paragraphs for text), the Hugging
    Face tokenizer encodes each document; EOS after each record and each text file.
    Returns the tokens and the start of each EOS-ended document."""
    import datasets

    tokenizer = gpt2_tokenizer()
    eos = tokenizer.eos_token_id
    tokens: list[int] = []
    starts: list[int] = []
    for path in paths:
        kind = {"a.txt": "text", "b.txt.gz": "text", "c.jsonl": "json"}.get(path.name, "parquet")
        options = {"sample_by": "paragraph"} if kind == "text" else {}
        table = datasets.load_dataset(kind, data_files=[str(path)], split="train", **options)
        if kind == "text":
            starts.append(len(tokens))
        for row in table:
            if kind == "text":
                tokens += tokenizer.encode(row["text"].rstrip("\n") + "\n\n")
            else:
                starts.append(len(tokens))
                tokens += [*tokenizer.encode(row["text"]), eos]
        if kind == "text":
            tokens.append(eos)
    return tokens, starts


@pytest.mark.parametrize("workers", [1, 2])
def test_tokens_and_document_index_equal_the_plain_computation(
    workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _inputs(tmp_path / "in")
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 40)  # many batches, even in a pool
    meta = prepare_corpus(paths, gpt2_tokenizer(), "text", tmp_path / "out", workers)
    tokens, starts = _reference(paths)
    assert np.fromfile(tmp_path / "out" / "tokens.bin", np.uint16).tolist() == tokens
    assert np.fromfile(tmp_path / "out" / "docs.bin", np.int64).tolist() == starts
    assert meta["n_tokens"] == len(tokens) and meta["n_docs"] == len(starts)
    # The full content hash of every input, taken while reading, is the file's own.
    for path, recorded in zip(paths, meta["files"], strict=True):
        assert recorded["xxh3_128"] == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert (
        meta["xxh3_128"]
        == xxhash.xxh3_128((tmp_path / "out" / "tokens.bin").read_bytes()).hexdigest()
    )
    assert not (tmp_path / "out" / "parts").exists()


def test_a_crash_keeps_the_inputs_already_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _inputs(tmp_path / "in")
    clean = prepare_corpus(paths, gpt2_tokenizer(), "text", tmp_path / "clean")
    real = prepare_module.iter_file_documents
    read: list[str] = []
    crashed: list[bool] = []

    def crash_on_the_third(path: Path, *args: object):  # type: ignore[no-untyped-def]
        read.append(path.name)
        if path.name == "c.jsonl" and not crashed:
            crashed.append(True)
            yield "half a document"
            raise Crash  # as a kill mid-file would stop it
        yield from real(path, *args)

    monkeypatch.setattr(prepare_module, "iter_file_documents", crash_on_the_third)
    with pytest.raises(Crash):
        prepare_corpus(paths, gpt2_tokenizer(), "text", tmp_path / "out")
    assert not (tmp_path / "out" / "meta.json").exists()  # no complete-looking cache
    assert len(list((tmp_path / "out" / "parts").glob("*.json"))) == 2
    read.clear()
    again = prepare_corpus(paths, gpt2_tokenizer(), "text", tmp_path / "out")
    assert read == ["c.jsonl", "d.parquet"]  # the two finished files were not read again
    assert again == clean
    for name in ("tokens.bin", "docs.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()


def test_cache_key_follows_size_mtime_and_sampled_content(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("some text\n\n" * 10)
    tokenizer = gpt2_tokenizer()
    key = token_folder([path], tokenizer, "text", tmp_path)
    assert token_folder([path], tokenizer, "text", tmp_path) == key
    os.utime(path, ns=(1, 1))  # same bytes, another modification time (a copy elsewhere)
    moved = token_folder([path], tokenizer, "text", tmp_path)
    path.write_text("Some text\n\n" * 10)  # same size, one byte changed
    os.utime(path, ns=(1, 1))
    assert len({key, moved, token_folder([path], tokenizer, "text", tmp_path)}) == 3


def test_the_start_check_is_sampled_unless_verify_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_read, "SAMPLE_BLOCK_BYTES", 256)  # 16 x 256 B sampled
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n\n" * 2000)
    built = build_token_file([corpus], gpt2_tokenizer(), "text", tmp_path / "cache")
    data = bytearray(built.path.read_bytes())
    span = len(data) - 256
    assert span // 15 > 2 * 256  # the sampled blocks leave gaps
    middle = 256 + 100  # inside the gap after the first sampled block
    data[middle] ^= 0xFF
    built.path.write_bytes(bytes(data))
    sampled = build_token_file([corpus], gpt2_tokenizer(), "text", tmp_path / "cache")
    assert sampled.path.read_bytes() == bytes(data)  # not seen: the sample's limit
    data[5] ^= 0xFF  # inside the first sampled block: seen
    built.path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its recorded sampled hash"):
        build_token_file([corpus], gpt2_tokenizer(), "text", tmp_path / "cache")
    data = bytearray(built.path.read_bytes())
    data[middle] ^= 0xFF
    built.path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its recorded hash .*rebuilding it"):
        full = build_token_file([corpus], gpt2_tokenizer(), "text", tmp_path / "cache", "full")
    assert full.path.read_bytes() != bytes(data)  # rebuilt, the damage gone


@pytest.mark.parametrize("fail", [False, True], ids=["prepares", "fails"])
def test_waiting_ranks_outlast_the_collective_timeout(
    fail: bool, small_corpus: Path, tmp_path: Path
) -> None:
    from test_prepare_data_cases import TIMEOUT_S, slow_preparation

    from hybrid.instruments.local_processes import run_processes

    delay = 2 * TIMEOUT_S
    results = run_processes(
        slow_preparation, 2, str(small_corpus), str(tmp_path / "cache"), delay, fail
    )
    if fail:  # every rank reports rank 0's one line, nobody hangs
        assert [r["error"] for r in results] == [f"{small_corpus}: deliberately unreadable"] * 2
        return
    assert results[0]["n_train"] == results[1]["n_train"] > 0
    assert results[0]["total"] == 2 * results[0]["n_train"]
    assert results[1]["waited_s"] > delay  # it did wait, longer than the timeout, and lived


def test_command_line_prepares_what_training_reads(small_corpus: Path, tmp_path: Path) -> None:
    from launch.data import prepare_data
    from launch.prepare_data import main

    args = [f"data.files=[{small_corpus}]", f"data.cache_dir={tmp_path}", "data.tokenizer=gpt2"]
    assert main([*args, "--workers", "1"]) == 0
    (folder,) = (tmp_path / "tokens").iterdir()
    stamp = (folder / "meta.json").stat().st_mtime_ns
    from launch.config import load_config

    data = prepare_data(load_config(None, args).data)  # found in the cache, not rebuilt
    assert (folder / "meta.json").stat().st_mtime_ns == stamp
    assert len(data.train_tokens) + len(data.val_tokens) > 40_000
    assert main([*args, "--workers", "-1"]) == 2


def test_command_line_prepares_a_bpe_mixture_that_training_finds_cached(
    small_corpus: Path, tmp_path: Path
) -> None:
    """A bpe mixture is prepared with the vocabulary training uses (one, trained on every
    source): after the command, loading the mixture adds no token file and rewrites none."""
    from launch.config import load_config
    from launch.data.mixture import load_mixture
    from launch.prepare_data import main

    text = small_corpus.read_text()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(text[:100_000])
    b.write_text(text[100_000:])
    cache = tmp_path / "cache"
    args = [
        f"data.mixture=[{{files: [{a}], weight: 0.7}}, {{files: [{b}], weight: 0.3}}]",
        f"data.cache_dir={cache}", "data.tokenizer=bpe", "data.bpe_vocab_size=320",
    ]  # fmt: skip
    assert main([*args, "--workers", "1"]) == 0
    built = {p: p.stat().st_mtime_ns for p in (cache / "tokens").glob("*/meta.json")}
    assert len(built) == 2
    load_mixture(load_config(None, args).data, 32)
    assert {p: p.stat().st_mtime_ns for p in (cache / "tokens").glob("*/meta.json")} == built
