"""hybrid.instruments.local_processes.run_processes, which every multi-process test stands on:
results in rank order, a child's traceback when it raises, and a child that dies without a word
named at once rather than after the whole timeout."""

from __future__ import annotations

import os
import time

import pytest

from hybrid.instruments.local_processes import run_processes


def _rank_and_env(name: str) -> tuple[int, str | None]:
    return int(os.environ["RANK"]), os.environ.get(name)


def _raise_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one says no")


def _die_silently() -> None:
    os._exit(3)


def test_results_come_back_in_rank_order_with_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Set after the fork server started (other tests started it): children must see it.
    monkeypatch.setenv("HYBRID_TEST_MARK", "now")
    assert run_processes(_rank_and_env, 2, "HYBRID_TEST_MARK") == [(0, "now"), (1, "now")]


def test_a_raising_child_shows_its_traceback() -> None:
    with pytest.raises(AssertionError, match="rank 1 failed(.|\n)*ValueError: rank one says no"):
        run_processes(_raise_on_rank_one, 2)


def test_a_child_that_dies_silently_is_named_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="exited with code 3 before reporting"):
        run_processes(_die_silently, 2, timeout_s=120)
    assert time.monotonic() - start < 30
