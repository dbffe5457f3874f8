"""Deterministic, resumable batches over a packed token array, sharded by data-parallel rank.

The token array is cut into non-overlapping windows of seq_len + 1 tokens (inputs and the
targets shifted by one). Each epoch visits every window once in an order drawn from
(seed, epoch). Position in the data is one number, the *global sample index*: how many
windows all ranks together have consumed. It does not depend on the layout, so a run can
resume from it at any dp.

Step t uses global samples [t*G, (t+1)*G) for a global batch G. Data-parallel rank r
takes the r-th contiguous G/dp of them and cuts those into micro-batches; a single process
(dp = 1) sees exactly the union of what the ranks see, in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class Samples(Protocol):
    """Numbered training samples: TokenWindows, or launch.data.examples.Examples."""

    def __len__(self) -> int: ...

    def batch(self, ids: np.ndarray) -> Any: ...


class TokenWindows:
    """Windows of `seq_len + 1` tokens over a 1-D token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of seq_len+1={seq_len + 1}; "
                "use more data, a shorter model.seq_len or a larger data.val_fraction"
            )

    def __len__(self) -> int:
        return self.n

    def batch(self, ids: np.ndarray) -> torch.Tensor:
        """(len(ids), seq_len + 1) int64 tensor of the given windows."""
        starts = np.asarray(ids, dtype=np.int64) * self.seq_len
        rows = [np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


class ShuffledSampler:
    """Global sample index -> window id: a fresh permutation per epoch, drawn from the seed."""

    def __init__(self, n_windows: int, seed: int) -> None:
        self.n, self.seed = n_windows, seed
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def window_ids(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for i, index in enumerate(range(start, start + count)):
            epoch, position = divmod(index, self.n)
            if epoch != self._epoch:
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            out[i] = self._order[position]
        return out


class DistributedBatches:
    """The micro-batches this DP rank trains on, step after step, from a global sample index."""

    def __init__(
        self,
        windows: Samples,
        seed: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_sample: int = 0,
    ) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by "
                f"micro batch x dp = {micro_batch_size} x {dp_size}"
            )
        self.windows = windows
        self.sampler = ShuffledSampler(len(windows), seed)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = start_sample  # the global sample index; save it to resume

    def next_step(self) -> list[Any]:
        """This rank's micro-batches for the next optimizer step; advances the position."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        ids = self.sampler.window_ids(start, per_rank)
        self.consumed_samples += self.global_batch_size
        mb = self.micro_batch_size
        return [self.windows.batch(ids[i : i + mb]) for i in range(0, per_rank, mb)]


def eval_batches(
    windows: Samples, n_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[Any]:
    """A fixed validation set: the first `n_samples` windows in order (capped at what the
    split holds), dealt round-robin across DP ranks so each sample is counted once."""
    ids = np.arange(min(n_samples, len(windows)))[dp_rank::dp_size]
    return [
        windows.batch(ids[i : i + micro_batch_size]) for i in range(0, len(ids), micro_batch_size)
    ]
