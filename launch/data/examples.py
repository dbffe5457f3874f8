"""Supervised fine-tuning data: jsonl records of `prompt` and `completion`, the loss taken
on the completion only.

    {"prompt": "Translate to French: cheese", "completion": " fromage"}

Each record becomes one sequence: the prompt's tokens (with the special tokens the
tokenizer adds, such as a beginning-of-sequence token), the completion's, then the
end-of-text token, so the model learns where to stop. Targets are the same tokens shifted
by one, with IGNORE_INDEX wherever the token to predict is part of the prompt or padding.
A sequence longer than the window is cut at its end; a record whose prompt fills the whole
window has nothing to learn from and is dropped (counted in `dropped`).

Records are not packed together: attention would otherwise cross from one example into
the next. The set is small enough to tokenize into memory once per run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from models.gpt import IGNORE_INDEX

from .jsonl import read_jsonl

PROMPT, COMPLETION = "prompt", "completion"


def is_prompt_completion(paths: list[Path]) -> bool:
    """True when the files are jsonl whose first record has `prompt` and `completion`
    (then every record must); plain text, parquet or `text` records are packed instead."""
    if not all(_is_jsonl(path) for path in paths):
        return False
    for path in paths:
        for _, record in _records(path, check=False):
            return isinstance(record, dict) and PROMPT in record and COMPLETION in record
    return False


@dataclass
class Examples:
    """Padded sequences of `window + 1` tokens and their loss labels (IGNORE_INDEX where
    no loss is taken), one row per record."""

    tokens: np.ndarray  # (n, window + 1) int64
    labels: np.ndarray  # (n, window + 1) int64
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(ids), window): targets are labels shifted by one."""
        ids = np.asarray(ids, dtype=np.int64)
        inputs = torch.from_numpy(self.tokens[ids, :-1].copy())
        return inputs, torch.from_numpy(self.labels[ids, 1:].copy())

    def split(self, val_fraction: float) -> tuple[Examples, Examples]:
        """The last `val_fraction` of the records (at least one) validate."""
        n_val = max(1, round(len(self) * val_fraction))
        if len(self) - n_val < 1:
            raise ValueError(
                f"{len(self)} usable prompt/completion records cannot make both a training "
                "and a validation set; add records or lower data.val_fraction"
            )
        cut = len(self) - n_val
        return (
            Examples(self.tokens[:cut], self.labels[:cut], self.dropped),
            Examples(self.tokens[cut:], self.labels[cut:]),
        )


def read_examples(paths: list[Path], tokenizer: PreTrainedTokenizerBase, window: int) -> Examples:
    """Tokenize every record of `paths` into sequences of at most `window + 1` tokens."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-text token to end each completion with")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts, completions = [], []
    for path in paths:
        for _, record in _records(path, check=True):
            prompts.append(record[PROMPT])
            completions.append(record[COMPLETION])
    if not prompts:
        raise ValueError(f"{', '.join(map(str, paths))} hold no prompt/completion records")
    prompt_ids = tokenizer(prompts)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    tokens = np.full((len(prompts), window + 1), pad, dtype=np.int64)
    labels = np.full((len(prompts), window + 1), IGNORE_INDEX, dtype=np.int64)
    kept = 0
    for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
        sequence = (prompt + completion + [eos])[: window + 1]
        if len(prompt) >= len(sequence):
            continue  # the prompt fills the window: no completion token left to learn
        tokens[kept, : len(sequence)] = sequence
        labels[kept, len(prompt) : len(sequence)] = sequence[len(prompt) :]
        kept += 1
    if kept == 0:
        raise ValueError(
            f"every prompt is at least train.seq_len={window} tokens long, so no completion "
            "token fits; raise train.seq_len or shorten the prompts"
        )
    return Examples(tokens[:kept], labels[:kept], dropped=len(prompts) - kept)


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
