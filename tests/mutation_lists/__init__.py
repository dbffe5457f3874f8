"""The mutation list of tests/mutations.py, one module per concern of the code mutated."""

from __future__ import annotations

from mutation_lists import any_model, benchmarks, checkpoint, engine, launch, model, planning
from mutation_lists.mutation import Mutation

MUTATIONS: list[Mutation] = [
    *engine.MUTATIONS,
    *checkpoint.MUTATIONS,
    *planning.MUTATIONS,
    *launch.MUTATIONS,
    *model.MUTATIONS,
    *any_model.MUTATIONS,
    *benchmarks.MUTATIONS,
]

__all__ = ["MUTATIONS", "Mutation"]
