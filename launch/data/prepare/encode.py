"""Tokenizing batches of documents, in this process or in a pool of worker processes.

launch.data.prepare.corpus cuts each input into batches of text and writes the parts;
this module only turns batches into token ids: `encode_texts` for one batch, `_encoded`
for a stream of them, in order, with at most `depth` batches in flight in a pool whose
processes each hold their own copy of the tokenizer's Rust backend (`tokenizers`, set up
by `_init_worker`). It is separate so that what runs inside a worker process (and the
per-process tokenizer it keeps in a module global) stays apart from the files and parts
the main process writes.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from itertools import chain
from typing import Any

import numpy as np

_worker_tokenizer: Any = None


def encode_texts(
    encoder: Any, texts: list[str], dtype: np.dtype, eos: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts`, concatenated, and each text's length; with `eos`, one
    end-of-text token after each. `encoder`: a `tokenizers.Tokenizer`, or a slow
    Hugging Face tokenizer (no Rust backend) as a fallback."""
    if hasattr(encoder, "encode_batch_fast"):  # no offsets computed: we never read them
        ids = [e.ids for e in encoder.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        ids = encoder(texts, add_special_tokens=False)["input_ids"]
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype, int(lengths.sum()))
    if eos is not None:
        flat = np.insert(flat, np.cumsum(lengths), eos).astype(dtype, copy=False)
        lengths += 1
    return flat, lengths


def _init_worker(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    # One process per core already: Rust threads inside each would only contend.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode_in_worker(
    texts: list[str], dtype: np.dtype, eos: int | None
) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_worker_tokenizer, texts, dtype, eos)


def _encoded(
    batches: Iterator[list[str]], tokenizer: Any, dtype: np.dtype, eos: int | None, pool: Any,
    depth: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """Each batch's (ids, lengths) in order; with a pool, at most `depth` in flight."""
    if pool is None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        for batch in batches:
            yield encode_texts(backend, batch, dtype, eos)
        return
    pending: deque[Any] = deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_in_worker, (batch, dtype, eos)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
