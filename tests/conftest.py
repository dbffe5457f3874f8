from __future__ import annotations

import gzip
import os
import sys
from pathlib import Path

import pytest
import torch

from hybrid.instruments.local_processes import preload

ROOT = Path(__file__).resolve().parent.parent
# Each concern's folder holds its tests and the worker modules (`*_cases.py`) that spawned
# ranks import by name: every folder goes on the path before the preload server forks.
for folder in sorted((ROOT / "tests").iterdir(), reverse=True):
    if folder.is_dir() and any(folder.glob("*.py")) and folder.name != "mutation_lists":
        sys.path.insert(0, str(folder))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for each rank
# torch is imported already (hybrid.instruments.local_processes): the variable no longer reaches
# this process's own references, which on 2 busy cores ran up to 30x slower on two threads.
torch.set_num_threads(1)
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Children of run_processes fork from a server that has these loaded: a child then starts in
# milliseconds instead of importing torch, transformers and datasets again (most of the
# suite's time on 2 cores).
# torch._dynamo: torch.optim's first optimizer imports it (~2 s a child otherwise).
preload(
    [
        "torch.distributed.checkpoint",
        "torch._dynamo",
        "transformers",
        "transformers.models.auto.tokenization_auto",
        "datasets",
        "launch.pretrain",
    ]
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One token/tokenizer cache for the whole session, so each corpus is encoded once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 200 kB of the bundled Shakespeare, as a local text file."""
    from launch.data.token_file import BUNDLED_CORPUS

    path = tmp_path_factory.mktemp("corpus") / "shakespeare-small.txt"
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        path.write_text(f.read(200_000))
    return path
