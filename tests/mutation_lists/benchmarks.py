"""Mutations of the benchmark harness's timing (benchmarks/compare/alternated.py,
benchmarks/speed/peer_speed.py): a benchmark that measures something else than it says is
a defect too."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

TEST = "tests/peers/test_peer_speed.py::"
MUTATIONS = [
    Mutation(
        "the alternated job runs the systems in the same order every round",
        "benchmarks/compare/alternated.py",
        "    return items[k:] + items[:k]\n",
        "    return items\n",
        (TEST + "test_every_system_runs_in_every_position_equally_often",),
    ),
    Mutation(
        "a round's wall time is the fastest rank's, not the slowest's",
        "benchmarks/speed/peer_speed.py",
        'max(ranks) if clock == "wall"',
        'min(ranks) if clock == "wall"',
        (TEST + "test_a_rounds_ratio_pairs_that_rounds_blocks",),
    ),
    Mutation(
        "every block is filed under the first system",
        "benchmarks/compare/alternated.py",
        '"system": i, "wall"',
        '"system": 0, "wall"',
        (TEST + "test_ours_and_the_plain_loop_side_by_side_train_the_same_model",),
    ),
    Mutation(
        "the heap instrument reads every anonymous mapping, not the main arena",
        "benchmarks/memory/heap_growth.py",
        'in_heap = len(fields) > 5 and fields[5] == "[heap]"',
        "in_heap = len(fields) <= 5",
        ("tests/peers/test_heap_growth.py::test_heap_rss_follows_blocks_malloc_keeps_on_the_heap",),
    ),
    Mutation(
        "the heap instrument reads the size of the mapping, not what is resident",
        "benchmarks/memory/heap_growth.py",
        'fields[0] == "Rss:"',
        'fields[0] == "Size:"',
        ("tests/peers/test_heap_growth.py::test_heap_rss_follows_blocks_malloc_keeps_on_the_heap",),
    ),
]
