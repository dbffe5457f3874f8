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
]
