"""Deterministic, resumable batches over a packed token array, sharded by data-parallel rank.

The token array is cut into non-overlapping windows of seq_len + 1 tokens (inputs and the
targets shifted by one). Each epoch visits every window once in an order drawn from
(seed, epoch). Position in the data is one number, the *global sample index*: how many
windows all ranks together have consumed. It does not depend on the layout, so a run can
resume from it at any dp.

The order is a keyed bijection of the window ids computed on the fly (a Feistel network,
FeistelPermutation), never a stored permutation: memory stays O(batch) whether the corpus
holds a thousand windows or a billion (10^12 tokens in windows of 1024).

Step t uses global samples [t*G, (t+1)*G) for a global batch G. Data-parallel rank r
takes the r-th contiguous G/dp of them and cuts those into micro-batches; a single process
(dp = 1) sees exactly the union of what the ranks see, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

ROUNDS = 6  # Luby-Rackoff: 4 rounds of a good round function already give a random-looking order
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class Samples(Protocol):
    """Numbered training samples: TokenWindows, or launch.data.examples.Examples."""

    def __len__(self) -> int: ...

    def batch(self, ids: np.ndarray) -> Any: ...


class IndexSampler(Protocol):
    """Global sample index -> sample id, what DistributedBatches walks."""

    def window_ids(self, start: int, count: int) -> np.ndarray: ...


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


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective 64-bit hash (numpy's uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed bijection of [0, n), evaluated for an array of positions at a time.

    A balanced Feistel network on the 2h bits of the smallest power of four >= n is a
    permutation of that larger domain whatever its round function; cycle-walking (apply
    it again while the result is >= n) restricts it to a permutation of [0, n). The domain
    is under 4n, so a position needs fewer than 4 passes on average.
    """

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"cannot permute {n} items")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.SeedSequence(list(key)).generate_state(ROUNDS, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The images of `positions` (each in [0, n)) as int64."""
        out = self._rounds(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(out >= self.n)
        while outside.size:
            out[outside] = self._rounds(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64)


class ShuffledSampler:
    """Global sample index -> window id: a fresh permutation per epoch, keyed by
    (seed, stream, epoch). `stream` tells apart samplers that share a seed (the sources of
    a mixture)."""

    def __init__(self, n_windows: int, seed: int, stream: int = 0) -> None:
        self.n, self.seed, self.stream = n_windows, seed, stream
        self._epoch, self._order = -1, None

    def window_ids(self, start: int, count: int) -> np.ndarray:
        return self.ids_at(np.arange(start, start + count, dtype=np.int64))

    def ids_at(self, index: np.ndarray) -> np.ndarray:
        """The window ids of the given global sample indices (any order, any epochs)."""
        epoch, position = np.divmod(np.asarray(index, dtype=np.int64), self.n)
        out = np.empty(len(position), dtype=np.int64)
        for e in np.unique(epoch):  # one or two epochs per batch, unless the data is tiny
            chosen = epoch == e
            out[chosen] = self._permutation(int(e))(position[chosen])
        return out

    def _permutation(self, epoch: int) -> FeistelPermutation:
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = FeistelPermutation(self.n, (self.seed, self.stream, epoch))
        return self._order


def sampler_for(windows: Samples, seed: int) -> IndexSampler:
    """The windows' own sampler when they bring one (a mixture: launch.data.mixture), else
    a shuffle of their ids."""
    own = getattr(windows, "sampler", None)
    return own(seed) if own is not None else ShuffledSampler(len(windows), seed)


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
        self.sampler = sampler_for(windows, seed)
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
