"""Token files hold uint16 ids when every id fits, else uint32 (README, "Data and
tokenizers"): a tokenizer of more than 65536 ids must not have its ids wrapped modulo 2^16.

The tokenizer is a real local Hugging Face folder (a word-level tokenizer whose corpus
words sit at the top of the vocabulary, so the ids written are the largest ones), read
through `prepare_data` as `data.tokenizer=<folder>` is; nothing downloads. 65536 ids
(0..65535) is the largest vocabulary that fits uint16, 65537 the smallest that does not:
an off-by-one in the choice, or a file always written as uint16, changes the ids read back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from launch.config import DataConfig
from launch.data import prepare_data

EOS = "<|endoftext|>"
TEXT = "to be or not to be\n\nthat is the question\n\nwhether tis nobler in the mind\n"


def _word_tokenizer(folder: Path, n_ids: int) -> dict[str, int]:
    """Save a word-level tokenizer of exactly `n_ids` ids to `folder`; the end-of-text token
    is the last id and the corpus words the ones just below it. Returns the vocabulary."""
    words = sorted(set(TEXT.split()))
    vocab = {f"<unused{i}>": i for i in range(n_ids - len(words) - 1)}
    vocab |= {word: n_ids - 2 - i for i, word in enumerate(words)}
    vocab[EOS] = n_ids - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, unk_token=EOS)
    assert len(tokenizer) == n_ids
    tokenizer.save_pretrained(str(folder))
    return vocab


@pytest.mark.parametrize(
    ("n_ids", "dtype"), [(65536, np.uint16), (65537, np.uint32)], ids=["65536-ids", "65537-ids"]
)
def test_token_file_dtype_follows_the_vocabulary_and_reads_back_exactly(
    n_ids: int, dtype: type, tmp_path: Path
) -> None:
    vocab = _word_tokenizer(tmp_path / "tokenizer", n_ids)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    config = DataConfig(
        files=[str(corpus)],
        tokenizer=str(tmp_path / "tokenizer"),
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.25,
    )
    # What was written: every word's id in order, then one end-of-text for the text file.
    written = [vocab[word] for word in TEXT.split()] + [vocab[EOS]]
    assert max(written) == n_ids - 1  # the largest id of the vocabulary is in the file

    for attempt in ("built", "cached"):  # the second call reads the cache's meta.json
        data = prepare_data(config)
        assert data.train_tokens.dtype == data.val_tokens.dtype == dtype, attempt
        read = np.concatenate([data.train_tokens, data.val_tokens]).tolist()
        assert read == written, attempt
        assert len(data.val_tokens) == len(written) - int(len(written) * 0.75)

    (folder,) = (tmp_path / "cache" / "tokens").iterdir()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dtype"] == np.dtype(dtype).name and meta["vocab"] == n_ids
    assert (folder / "tokens.bin").stat().st_size == len(written) * np.dtype(dtype).itemsize
