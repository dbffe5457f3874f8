"""The sampler's on-the-fly permutation (launch.data.sampler): a bijection of the window ids
per epoch, keyed by the seed, in memory that does not grow with the corpus."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from launch.data.sampler import FeistelPermutation, ShuffledSampler

TRILLION_TOKENS_WINDOWS = 10**12 // 1024  # 10^12 tokens in windows of 1024


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 16, 17, 100, 1000, 4097])
def test_every_epoch_visits_each_window_once(n: int) -> None:
    ids = ShuffledSampler(n, seed=7).window_ids(0, 3 * n)
    for epoch in range(3):
        assert np.array_equal(np.sort(ids[epoch * n : (epoch + 1) * n]), np.arange(n))


def test_deterministic_from_the_seed_and_fresh_each_epoch() -> None:
    n = 1000
    a, b = ShuffledSampler(n, 7).window_ids(0, 3 * n), ShuffledSampler(n, 7).window_ids(0, 3 * n)
    assert np.array_equal(a, b)
    other_seed = ShuffledSampler(n, 8).window_ids(0, n)
    other_stream = ShuffledSampler(n, 7, stream=1).window_ids(0, n)
    epochs = [a[:n], a[n : 2 * n], a[2 * n :], other_seed, other_stream]
    for i in range(len(epochs)):
        for j in range(i):  # two random orders of 1000 agree in about one place
            assert np.mean(epochs[i] == epochs[j]) < 0.01


def test_the_order_looks_random() -> None:
    n = 10_000
    ids = ShuffledSampler(n, 3).window_ids(0, n)
    assert abs(np.corrcoef(np.arange(n), ids)[0, 1]) < 0.05  # not the identity, nor near it
    # The first window of an epoch, over 4000 seeds, is about uniform over 10 windows.
    first = [ShuffledSampler(10, seed).window_ids(0, 1)[0] for seed in range(4000)]
    counts = np.bincount(first, minlength=10)
    assert counts.min() > 320 and counts.max() < 480, counts  # 400 expected, sd 19


def test_resume_at_any_index_continues_the_same_sequence() -> None:
    n = 37
    whole = ShuffledSampler(n, 5).window_ids(0, 10 * n)
    for start in [0, 1, 36, 37, 38, 100, 200, 333]:
        resumed = ShuffledSampler(n, 5)  # a new process: nothing cached
        assert np.array_equal(resumed.window_ids(start, 29), whole[start : start + 29]), start
    index = np.array([300, 5, 77, 5, 0])
    assert np.array_equal(ShuffledSampler(n, 5).ids_at(index), whole[index])


def test_window_ids_at_a_trillion_tokens_in_constant_memory() -> None:
    """The memory of a batch's ids is the same for a thousand windows as for a billion:
    nothing per window is ever stored (a permutation of 10^9 would take 8 GB)."""
    ShuffledSampler(5, seed=0).window_ids(0, 4096)  # numpy's one-time allocations, not counted
    peaks = []
    for n in [10**4, 10**6, TRILLION_TOKENS_WINDOWS]:
        sampler = ShuffledSampler(n, seed=1234)
        start = 3 * n - 2000  # crosses from epoch 2 into epoch 3
        tracemalloc.start()
        ids = sampler.window_ids(start, 4096)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert ids.min() >= 0 and ids.max() < n
        assert len(set(ids[:2000].tolist())) == 2000  # one epoch's part: no repeats
        assert peaks[-1] < 1.5 * peaks[0] + 64 * 1024, peaks
    assert peaks[0] < 2**20  # about 16 arrays of 4096 words

    # Deterministic: another process computes the same ids, here and far into the run.
    n = TRILLION_TOKENS_WINDOWS
    far = 7 * n + 123_456_789
    again = ShuffledSampler(n, seed=1234)
    assert np.array_equal(again.window_ids(far, 64), ShuffledSampler(n, 1234).window_ids(far, 64))
    assert not np.array_equal(
        again.window_ids(far, 64), ShuffledSampler(n, 1235).window_ids(far, 64)
    )
    # Pinned values: the order is part of a checkpoint's meaning (resume on any machine).
    assert ShuffledSampler(n, 1234).window_ids(0, 3).tolist() == PINNED


PINNED = [763006526, 846889990, 86023984]  # ShuffledSampler(10**12 // 1024, 1234), 0..2


def test_the_permutation_rejects_an_empty_domain() -> None:
    with pytest.raises(ValueError, match="cannot permute 0 items"):
        FeistelPermutation(0, (1, 2))
