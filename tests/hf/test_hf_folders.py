"""Local Hugging Face datasets folders in data.files: text rows tokenized into the token
cache like any other input, input_ids rows appended as they are, each checked against a
plain computation on the same rows."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from launch.config import ConfigError, DataConfig, MixtureSource, load_config
from launch.data import prepare_data
from launch.data.prepare.corpus import prepare_corpus
from launch.data.token_file import resolve_files, token_folder
from launch.data.tokenizers import gpt2_tokenizer
from launch.train.entry import check_before_start

TEXTS = ["The first row.", None, "A second\n\nrow, of two paragraphs.", "", "Third", "ünï"]
IDS = [[5, 6, 7], [], [50256, 1], [0], None, [42] * 5]


def _save(kind: str, folder: Path, columns: dict[str, list]) -> Path:
    """Two data files, so the rows' order across files is tested too."""
    import datasets

    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict(columns)
    if kind == "parquet":
        (folder / "data").mkdir(parents=True)
        half = len(table) // 2
        table.select(range(half)).to_parquet(str(folder / "data" / "train-0.parquet"))
        table.select(range(half, len(table))).to_parquet(str(folder / "data" / "train-1.parquet"))
    else:
        table.save_to_disk(str(folder), num_shards=2)
    return folder


def _prepared(files: list[Path], cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document starts) that prepare_data leaves in the cache."""
    data = DataConfig(files=[str(f) for f in files], tokenizer="gpt2", cache_dir=str(cache))
    prepared = prepare_data(data)
    tokens = np.concatenate([np.asarray(prepared.train_tokens), np.asarray(prepared.val_tokens)])
    folder = token_folder(resolve_files(data.files), prepared.tokenizer, "text", cache)
    return tokens, np.fromfile(folder / "docs.bin", np.int64)


def _text_reference(texts: list[str | None]) -> tuple[list[int], list[int]]:
    """The tokenizer applied to each non-null row in order, end-of-text after each (as for
    jsonl and parquet records), and where each row starts."""
    tokenizer = gpt2_tokenizer()
    tokens: list[int] = []
    starts: list[int] = []
    for text in texts:
        if text is not None:
            starts.append(len(tokens))
            tokens += tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens.append(tokenizer.eos_token_id)
    return tokens, starts


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_text_rows_are_tokenized_like_records(kind: str, tmp_path: Path) -> None:
    folder = _save(kind, tmp_path / "text", {"text": TEXTS, "n": list(range(len(TEXTS)))})
    tokens, starts = _prepared([folder], tmp_path / "cache")
    reference, reference_starts = _text_reference(TEXTS)
    assert tokens.tolist() == reference and starts.tolist() == reference_starts
    # with a text file after it: one cache, the folder's rows first
    other = tmp_path / "more.txt"
    other.write_text("More text.\n")
    tokens, starts = _prepared([folder, other], tmp_path / "cache")
    tail = gpt2_tokenizer()("More text.\n\n", add_special_tokens=False)["input_ids"]
    assert tokens.tolist() == reference + tail + [50256]
    assert starts.tolist() == [*reference_starts, len(reference)]


def test_text_rows_through_worker_processes(tmp_path: Path) -> None:
    texts = [f"Row {i}: " + "word " * (i % 7) for i in range(3000)]
    folder = _save("parquet", tmp_path / "text", {"text": texts})
    meta = prepare_corpus([folder], gpt2_tokenizer(), "text", tmp_path / "out", workers=2)
    tokens = np.fromfile(tmp_path / "out" / "tokens.bin", meta["dtype"])
    assert tokens.tolist() == _text_reference(texts)[0] and meta["n_docs"] == len(texts)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_input_ids_rows_are_appended_as_they_are(kind: str, tmp_path: Path) -> None:
    folder = _save(kind, tmp_path / "ids", {"input_ids": IDS})
    tokens, starts = _prepared([folder], tmp_path / "cache")
    rows = [row for row in IDS if row is not None]  # null rows skipped, empty rows kept
    assert tokens.tolist() == [t for row in rows for t in row]  # no separator added
    assert starts.tolist() == np.cumsum([0, *map(len, rows)])[:-1].tolist()


def test_an_id_outside_the_vocabulary_is_one_line_naming_the_row(tmp_path: Path) -> None:
    folder = _save("arrow", tmp_path / "ids", {"input_ids": [[1, 2], None, [3, 50257, 4]]})
    with pytest.raises(ValueError) as caught:
        _prepared([folder], tmp_path / "cache")
    assert str(caught.value) == (
        f"{folder}: row 2: token id 50257 at offset 1 is outside the vocabulary [0, 50257) of "
        "data.tokenizer; set data.tokenizer to the tokenizer the input_ids come from"
    )


def test_editing_a_file_in_the_folder_changes_the_cache_key(tmp_path: Path) -> None:
    import datasets

    folder = _save("parquet", tmp_path / "text", {"text": ["one", "two", "three", "four"]})
    tokenizer, cache = gpt2_tokenizer(), tmp_path / "cache"

    def key() -> Path:
        return token_folder(resolve_files([str(folder)]), tokenizer, "text", cache)

    first = key()
    assert key() == first  # stable while nothing changes
    _prepared([folder], cache)
    datasets.Dataset.from_dict({"text": ["four", "five"]}).to_parquet(
        str(folder / "data" / "train-1.parquet")
    )
    edited = key()
    assert edited != first
    assert (
        _prepared([folder], cache)[0].tolist() == _text_reference(["one", "two", "four", "five"])[0]
    )
    stat = (folder / "data" / "train-0.parquet").stat()
    os.utime(folder / "data" / "train-0.parquet", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert key() not in (first, edited)  # a touch alone: prepared again, as for a file
    (folder / "data" / "train-2.parquet").write_bytes(
        (folder / "data" / "train-1.parquet").read_bytes()
    )
    assert key() not in (first, edited)


def _config_error(tmp_path: Path, files: list[Path], *overrides: str) -> str:
    config = load_config(
        None,
        [f"data.files=[{','.join(map(str, files))}]", f"run_dir={tmp_path / 'run'}", *overrides],
    )
    with pytest.raises(ConfigError) as caught:
        check_before_start(config, 1)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_bad_folders_are_one_line_before_any_process_group(tmp_path: Path) -> None:
    good = _save("arrow", tmp_path / "good", {"text": ["a b c"] * 4})
    config = load_config(None, [f"data.files=[{good}]", f"run_dir={tmp_path / 'run'}"])
    assert check_before_start(config, 1) == 1  # an HF folder is accepted

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("text")
    assert _config_error(tmp_path, [tmp_path / "plain"]) == (
        f"data.files: {tmp_path / 'plain'} is a folder of neither kind read: a token-shard "
        "folder (manifest.json, launch.data.shards; the only entry) or a datasets folder "
        "(parquet files, or save_to_disk's state.json)"
    )
    no_files = _save("arrow", tmp_path / "nofiles", {"text": ["a", "b"]})
    state = (no_files / "state.json").read_text()
    (no_files / "state.json").write_text(state.replace('"filename"', '"x"').replace(
        '"_data_files": [', '"_data_files": [], "was": ['
    ))  # fmt: skip
    assert _config_error(tmp_path, [no_files]).endswith(
        "lists no data files; it is an empty source"
    )
    empty = _save("parquet", tmp_path / "empty", {"text": []})
    assert _config_error(tmp_path, [empty]) == (
        f"data.files: {empty} holds no documents (0 rows); it is an empty source"
    )
    other = _save("parquet", tmp_path / "other", {"body": ["a", "b"]})
    assert "has neither a 'text' nor an 'input_ids' column (columns: body)" in _config_error(
        tmp_path, [other]
    )
    ids = _save("arrow", tmp_path / "ids", {"input_ids": [[1, 2]] * 4})
    assert "data.tokenizer=bpe cannot be trained on it" in _config_error(
        tmp_path, [ids], "data.tokenizer=bpe"
    )
    mixture = f"data.mixture=[{{files: [{good}], weight: 1}}, {{files: [{empty}], weight: 1}}]"
    assert _config_error(tmp_path, [], mixture) == (
        f"data.mixture[1]: {empty} holds no documents (0 rows); it is an empty source"
    )


def test_pretraining_on_a_datasets_folder_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.files=[<input_ids folder>]: a run trains on its rows."""
    from small_run import TINY_CONFIG, small_run_overrides

    from launch import pretrain

    rows = np.random.default_rng(0).integers(0, 50257, (30, 200)).tolist()
    ids = _save("parquet", tmp_path / "ids", {"input_ids": rows})
    overrides = small_run_overrides(ids, tmp_path / "cache", tmp_path / "run")
    overrides += ["data.tokenizer=gpt2", "train.steps=2", "sample.tokens=0"]
    assert pretrain.main(["--config", str(TINY_CONFIG), *overrides]) == 0
    assert "5,700 train tokens" in capsys.readouterr().out  # 95% of the 6000 ids


def test_mixture_sources_may_be_datasets_folders(tmp_path: Path) -> None:
    """Each folder source gets its own cache, holding what the folder alone prepares to."""
    from launch.data.mixture import load_mixture

    lines = [f"Line {i} of some text." for i in range(300)]
    text = _save("arrow", tmp_path / "text", {"text": lines})
    ids = _save("parquet", tmp_path / "ids", {"input_ids": [[7] * 50, [9] * 50] * 20})
    data = DataConfig(tokenizer="gpt2", cache_dir=str(tmp_path / "cache"))
    sources = [MixtureSource([str(text)], 0.7), MixtureSource([str(ids)], 0.3)]
    _, train, _, description = load_mixture(dataclasses.replace(data, mixture=sources), 32)
    alone = [_prepared([folder], tmp_path / "cache")[0] for folder in (text, ids)]
    assert alone[0].tolist() == _text_reference(lines)[0] and alone[1].size == 2000
    for part, whole in zip(train.parts, alone, strict=True):
        assert len(part.tokens) == int(len(whole) * 0.95)
    assert description.startswith("train mixture text 70% (") and "ids 30% (1,900 tokens)" in (
        description
    )
