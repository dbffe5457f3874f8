"""Supervised fine-tuning data: jsonl records of `prompt` and `completion`, the loss taken
on the completion only.

    {"prompt": "Translate to French: cheese", "completion": " fromage"}

Each record becomes one example: the prompt's tokens (with the special tokens the
tokenizer adds, such as a beginning-of-sequence token), the completion's, then the
end-of-text token, so the model learns where to stop. Targets are the same tokens shifted
by one, with IGNORE_INDEX wherever the token to predict is part of the prompt or padding.
An example longer than the window is cut at its end; a record whose prompt fills the whole
window has nothing to learn from and is dropped (counted in `dropped`).

The records are tokenized once, streaming, into the cache (`<cache_dir>/examples/<key>/`):
every example's tokens end to end (uint16, or uint32 for vocabularies over 65,536), the
start offset of each example (int64) and its prompt length (int32, where the loss starts).
They are opened as memory maps, so a rank holds only the batches it reads, whatever the
number of examples. The key hashes each file's size, modification time and a sampled
content hash, the tokenizer, the window and the format version.

The rows (launch.data.example_rows, re-exported here): unpacked (the default), each
example is one row padded to the window. With `data.pack`, consecutive examples share a
row (PackedExamples) and carry segment ids, from which the model builds a block-diagonal
causal mask and positions that restart at every example
(models.gpt.attention.document_mask): no example attends to another, and the loss on
every completion token equals the unpacked one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from launch.data.example_rows import Examples, PackedExamples, _writer
from launch.data.jsonl import read_jsonl
from launch.data.tokenizers import tokenizer_fingerprint

PROMPT, COMPLETION = "prompt", "completion"
FORMAT_VERSION = "examples-v1"
_SAMPLE_BYTES, _SAMPLES = 1 << 16, 8  # the sampled content hash: 8 blocks of 64 KiB
_BATCH = 1024  # records tokenized at a time: bounds the build's memory


def is_prompt_completion(paths: list[Path]) -> bool:
    """True when the files are jsonl whose first record has `prompt` and `completion`
    (then every record must); plain text, parquet or `text` records are packed instead."""
    if not all(_is_jsonl(path) for path in paths):
        return False
    for path in paths:
        for _, record in _records(path, check=False):
            return isinstance(record, dict) and PROMPT in record and COMPLETION in record
    return False


def read_examples(
    paths: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    window: int,
    cache_dir: Path | str | None = None,
) -> Examples:
    """The examples of every record of `paths`, each at most `window + 1` tokens, from the
    cache under `cache_dir` (tokenized into it first if absent). Without `cache_dir` they
    are tokenized into a private folder removed at once (the open memory maps stay valid)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-text token to end each completion with")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if cache_dir is None:
        with tempfile.TemporaryDirectory() as folder:
            examples = _open(_build(Path(folder) / "set", paths, tokenizer, window), window, pad)
            examples.folder = None
            return examples
    key = hashlib.sha256(
        f"{FORMAT_VERSION}|{window}|{eos}|{tokenizer_fingerprint(tokenizer)}".encode()
    )
    for path in paths:
        key.update(_file_key(path).encode())
    folder = Path(cache_dir).expanduser() / "examples" / key.hexdigest()[:20]
    problem = _check(folder)
    if problem is not None:
        if folder.exists():
            message = f"example cache {folder} is corrupt: {problem}; rebuilding it"
            warnings.warn(message, stacklevel=2)
            shutil.rmtree(folder, ignore_errors=True)
        _build(folder, paths, tokenizer, window)
    return _open(folder, window, pad)


def _file_key(path: Path) -> str:
    """Size, modification time and a hash of 8 evenly spread 64 KiB blocks: a start costs
    at most 512 KiB of reading per file, however large, and an edit that keeps the size
    and the time (rare) still changes the key when it touches a sampled block."""
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}|{stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for k in range(_SAMPLES):
            f.seek(max(stat.st_size - _SAMPLE_BYTES, 0) * k // (_SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _build(
    folder: Path, paths: list[Path], tokenizer: PreTrainedTokenizerBase, window: int
) -> Path:
    """Tokenize the records `_BATCH` at a time, appending to the files of a temporary
    folder renamed to `folder` once complete: a crash leaves no half-built cache."""
    eos = tokenizer.eos_token_id
    dtype = np.dtype(np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32)
    tmp = folder.with_name(f"{folder.name}.{_writer()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n_records = n_kept = n_tokens = 0
    try:
        with (
            open(tmp / "tokens.bin", "wb") as tokens,
            open(tmp / "offsets.bin", "wb") as offsets,
            open(tmp / "prompt.bin", "wb") as prompts,
        ):
            offsets.write(np.zeros(1, np.int64).tobytes())
            for batch in _record_batches(paths):
                prompt_ids = tokenizer([r[PROMPT] for r in batch])["input_ids"]
                completion_ids = tokenizer([r[COMPLETION] for r in batch], add_special_tokens=False)
                kept, prompt_lengths = [], []
                for prompt, completion in zip(prompt_ids, completion_ids["input_ids"], strict=True):
                    sequence = (prompt + completion + [eos])[: window + 1]
                    if len(prompt) < len(sequence):  # else no completion token fits
                        kept.append(sequence)
                        prompt_lengths.append(len(prompt))
                n_records += len(batch)
                lengths = np.fromiter(map(len, kept), np.int64, len(kept))
                tokens.write(np.fromiter(chain.from_iterable(kept), dtype).tobytes())
                offsets.write((n_tokens + np.cumsum(lengths)).tobytes())
                prompts.write(np.asarray(prompt_lengths, np.int32).tobytes())
                n_kept, n_tokens = n_kept + len(kept), n_tokens + int(lengths.sum())
        if n_records == 0:
            raise ValueError(f"{', '.join(map(str, paths))} hold no prompt/completion records")
        if n_kept == 0:
            raise ValueError(
                f"every prompt is at least train.seq_len={window} tokens long, so no "
                "completion token fits; raise train.seq_len or shorten the prompts"
            )
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "n_examples": n_kept,
            "n_tokens": n_tokens,
            "dropped": n_records - n_kept,
            "files": [str(p) for p in paths],
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same cache first: keep its copy
            if _check(folder) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _check(folder: Path) -> str | None:
    """What is wrong with the cached set in `folder` (None when it is whole): its meta and
    the size of each file. Its content is derived data, so a bad set is rebuilt."""
    if not (folder / "meta.json").is_file():
        return "meta.json is missing"
    try:
        meta = json.loads((folder / "meta.json").read_text())
        n, itemsize = int(meta["n_examples"]), np.dtype(meta["dtype"]).itemsize
        if meta["format"] != FORMAT_VERSION:
            return f"format {meta['format']} is not {FORMAT_VERSION}"
        sizes = {
            "tokens.bin": int(meta["n_tokens"]) * itemsize,
            "offsets.bin": (n + 1) * 8,
            "prompt.bin": n * 4,
        }
    except (ValueError, KeyError, TypeError) as error:
        return f"meta.json is unreadable ({error})"
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or not {size} bytes"
    return None


def _open(folder: Path, window: int, pad: int) -> Examples:
    meta = json.loads((folder / "meta.json").read_text())
    n, dtype = int(meta["n_examples"]), np.dtype(meta["dtype"])
    tokens = np.memmap(folder / "tokens.bin", dtype, "r", shape=(int(meta["n_tokens"]),))
    offsets = np.memmap(folder / "offsets.bin", np.int64, "r", shape=(n + 1,))
    prompt = np.memmap(folder / "prompt.bin", np.int32, "r", shape=(n,))
    return Examples(tokens, offsets, prompt, window, pad, int(meta["dropped"]), folder)


def _record_batches(paths: list[Path]) -> Iterator[list[dict[str, str]]]:
    batch: list[dict[str, str]] = []
    for path in paths:
        for _, record in _records(path, check=True):
            batch.append(record)  # type: ignore[arg-type]  # checked: prompt and completion
            if len(batch) == _BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _records(path: Path, check: bool) -> Iterator[tuple[int, object]]:
    """(line number, record) of a jsonl file; with `check`, a record that is not a JSON
    object of string `prompt` and `completion` is an error naming the line."""
    for number, record in read_jsonl(path):
        if check:
            _check_record(record, f"{path}:{number}")
        yield number, record


def _check_record(record: object, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    for key in (PROMPT, COMPLETION):
        if not isinstance(record.get(key), str):
            found = "missing" if key not in record else f"a {type(record[key]).__name__}"
            raise ValueError(f"{where}: '{key}' must be a string ({found})")


def _is_jsonl(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    return bool(suffixes) and suffixes[-1] in (".jsonl", ".json")


__all__ = ["Examples", "PackedExamples", "is_prompt_completion", "read_examples"]
