"""The rows a cached set of fine-tuning examples is read as (launch.data.examples builds it).

Examples gives one example per row, padded to the window; PackedExamples puts consecutive
examples in a row ("next fit") with segment ids, its row starts cached next to the
examples. Both only index the memory-mapped tokens, offsets and prompt lengths; reading
the jsonl records and building, checking and opening the cache is launch.data.examples's
job, which imports these classes (and re-exports them), never the other way round.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from models.gpt import IGNORE_INDEX


class Examples:
    """Examples [first, last) of a cached set, one padded row of `window` inputs and
    targets each (IGNORE_INDEX where no loss is taken)."""

    def __init__(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        prompt: np.ndarray,
        window: int,
        pad: int,
        dropped: int = 0,
        folder: Path | None = None,
    ) -> None:
        self.tokens, self.offsets, self.prompt = tokens, offsets, prompt  # memory maps
        self.window, self.pad, self.dropped, self.folder = window, pad, dropped, folder

    def __len__(self) -> int:
        return len(self.prompt)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Example i's inputs and targets (its tokens but the last, and shifted by one
        with the prompt's targets ignored), at most `window` each."""
        sequence = np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)
        targets = sequence[1:].copy()
        targets[: max(int(self.prompt[i]) - 1, 0)] = IGNORE_INDEX
        return sequence[:-1], targets

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(ids), window), padded after each example."""
        ids = np.asarray(ids, dtype=np.int64)
        inputs = np.full((len(ids), self.window), self.pad, dtype=np.int64)
        targets = np.full((len(ids), self.window), IGNORE_INDEX, dtype=np.int64)
        for row, i in enumerate(ids):
            x, y = self.pair(int(i))
            inputs[row, : len(x)], targets[row, : len(y)] = x, y
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def split(
        self, val_fraction: float, packed: bool = False
    ) -> tuple[Examples, Examples] | tuple[PackedExamples, PackedExamples]:
        """The last `val_fraction` of the records (at least one) validate; with `packed`,
        each part is packed on its own (PackedExamples), so the same examples validate
        either way."""
        n_val = max(1, round(len(self) * val_fraction))
        if len(self) - n_val < 1:
            raise ValueError(
                f"{len(self)} usable prompt/completion records cannot make both a training "
                "and a validation set; add records or lower data.val_fraction"
            )
        cut = len(self) - n_val
        train, val = self._part(0, cut, self.dropped), self._part(cut, len(self), 0)
        if packed:
            return PackedExamples(train, f"0-{cut}"), PackedExamples(val, f"{cut}-{len(self)}")
        return train, val

    def _part(self, first: int, last: int, dropped: int) -> Examples:
        # offsets index the whole token file, so a part keeps the tokens and slices the rest
        offsets, prompt = self.offsets[first : last + 1], self.prompt[first:last]
        return Examples(self.tokens, offsets, prompt, self.window, self.pad, dropped, self.folder)


class PackedExamples:
    """Consecutive examples packed into rows of `window` tokens, in order ("next fit": a
    row takes examples until the next would not fit), so the rows depend only on the data
    and the window. A batch is (inputs, targets, segments): segment k of a row is its k-th
    example, the padding after the last one a segment of its own (it attends only to
    itself and takes no loss). The row starts are cached next to the examples."""

    def __init__(self, examples: Examples, part: str) -> None:
        self.examples = examples
        lengths = np.diff(examples.offsets) - 1  # inputs per example: its tokens but the last
        if examples.folder is None:
            self.starts = np.concatenate([*_next_fit(lengths, examples.window), [len(examples)]])
        else:
            self.starts = _cached_starts(examples.folder / f"pack-{part}.bin", lengths, examples)

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def dropped(self) -> int:
        return self.examples.dropped

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, segments), each (len(ids), window)."""
        ids = np.asarray(ids, dtype=np.int64)
        window = self.examples.window
        inputs = np.full((len(ids), window), self.examples.pad, dtype=np.int64)
        targets = np.full((len(ids), window), IGNORE_INDEX, dtype=np.int64)
        segments = np.empty((len(ids), window), dtype=np.int64)
        for row, b in enumerate(ids):
            end, members = 0, range(int(self.starts[b]), int(self.starts[b + 1]))
            for segment, i in enumerate(members):
                x, y = self.examples.pair(i)
                inputs[row, end : end + len(x)], targets[row, end : end + len(y)] = x, y
                segments[row, end : end + len(x)] = segment
                end += len(x)
            segments[row, end:] = len(members)
        return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(segments)


def _next_fit(lengths: np.ndarray, window: int, chunk: int = 1 << 20) -> Iterator[np.ndarray]:
    """The first example of each packed row, a chunk of rows at a time (every length is at
    most `window`: examples are cut to the window when tokenized)."""
    used = window + 1  # the first example opens a row
    for begin in range(0, len(lengths), chunk):
        starts = []
        for i, length in enumerate(np.asarray(lengths[begin : begin + chunk]).tolist(), begin):
            if used + length > window:
                starts.append(i)
                used = 0
            used += length
        yield np.asarray(starts, dtype=np.int64)


def _cached_starts(path: Path, lengths: np.ndarray, examples: Examples) -> np.ndarray:
    """The row starts of a packed part, written once next to the examples and memory
    mapped (their number grows with the data, like the offsets)."""
    if not path.is_file():  # written whole, then renamed: present means complete
        tmp = path.with_name(f"{path.name}.{_writer()}")
        with open(tmp, "wb") as f:
            for starts in _next_fit(lengths, examples.window):
                f.write(starts.tobytes())
            f.write(np.asarray([len(examples)], np.int64).tobytes())
        tmp.replace(path)
    return np.memmap(path, np.int64, "r")


def _writer() -> str:
    """A temporary name's suffix unique to this process, on any node of a shared folder."""
    return f"tmp-{socket.gethostname()}-{os.getpid()}"
