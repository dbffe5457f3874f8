"""A sharded save writes the engine's tensors without copying them (peak RSS): DCP's
writer clones any tensor whose storage is larger than itself and keeps every clone until
its file is written, so chunks that were plain views of the flat buffers cost a second
copy of everything a rank saves (hybrid.checkpoint.engine_state._own_storage)."""

from __future__ import annotations

from pathlib import Path

import checkpoint_memory_cases

from hybrid.instruments.local_processes import run_processes


def test_a_save_does_not_copy_what_it_writes(tmp_path: Path) -> None:
    for run in run_processes(checkpoint_memory_cases.save_peak, 2, str(tmp_path / "ckpt")):
        # Metadata, file buffers and page rounding only: a copy would add all of it.
        assert run["added"] < run["written"] / 5, run
