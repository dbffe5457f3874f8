"""Tokenizers: the shipped GPT-2 BPE, a BPE trained on the corpus, a local HF folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from launch.config import DataConfig
from launch.data import load_tokenizer
from launch.data.tokenizers import GPT2_DIR, gpt2_tokenizer, load_tokenizer_folder

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n  Ünïcödé — ok 123\n"


def test_gpt2_merges_file_is_the_real_one() -> None:
    digest = hashlib.sha256((GPT2_DIR / "merges.txt").read_bytes()).hexdigest()
    assert digest == "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


def test_gpt2_ids_for_a_known_sentence() -> None:
    tokenizer = gpt2_tokenizer()
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [15496, 995]
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256


@pytest.mark.parametrize("name", ["gpt2", "bpe"])
def test_round_trip(name: str, small_corpus: Path, cache_dir: Path) -> None:
    config = DataConfig(
        files=[str(small_corpus)], tokenizer=name, bpe_vocab_size=300, cache_dir=str(cache_dir)
    )
    tokenizer = load_tokenizer(config)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    if name == "bpe":
        assert len(tokenizer) == 300
        assert max(ids) < 300


def test_trained_bpe_is_cached(small_corpus: Path, cache_dir: Path) -> None:
    config = DataConfig(
        files=[str(small_corpus)], tokenizer="bpe", bpe_vocab_size=280, cache_dir=str(cache_dir)
    )
    first = load_tokenizer(config)
    saved = list((cache_dir / "tokenizers").glob("bpe-280-*/tokenizer.json"))
    assert len(saved) == 1
    mtime = saved[0].stat().st_mtime_ns
    again = load_tokenizer(config)
    assert saved[0].stat().st_mtime_ns == mtime  # loaded, not retrained
    assert again.encode(TEXT) == first.encode(TEXT)


def test_hugging_face_folder(tmp_path: Path) -> None:
    gpt2_tokenizer().save_pretrained(str(tmp_path / "tok"))
    tokenizer = load_tokenizer_folder(tmp_path / "tok")
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [15496, 995]
    with pytest.raises(FileNotFoundError, match="neither 'gpt2', 'bpe' nor an existing"):
        load_tokenizer_folder(tmp_path / "missing")
