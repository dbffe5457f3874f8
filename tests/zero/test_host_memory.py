"""Host memory the engine frees goes back to the operating system
(hybrid.distributed.host_memory): the heap's free pages are returned after the engine is
built, so a process's resident set follows its live tensors from the first step on."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hybrid.engine
from hybrid.distributed.host_memory import _glibc_function
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT, GPTConfig

GLIBC = _glibc_function("malloc_trim") is not None

# A fresh interpreter, the engine's mmap threshold (768 KiB) fixed: 256 KiB blocks come
# from the heap; one small block allocated after them keeps the heap's top from shrinking
# when they are freed, so only malloc_trim's walk over the free pages can return them.
HEAP = """
import re, torch
from hybrid.distributed.host_memory import release_freed_memory, trim_freed_memory
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
assert release_freed_memory()
blocks = [torch.ones(64 << 10) for _ in range(256)]  # 64 MiB of 256 KiB blocks, touched
pin = torch.ones(16)
del blocks
before = rss()
assert trim_freed_memory(torch.device("cpu"))
print(before - rss())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim: Linux with glibc only")
def test_freed_heap_pages_go_back_to_the_os() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HEAP], capture_output=True, text=True, timeout=120, check=True
    )
    returned = int(out.stdout.split()[-1])
    assert returned >= 48 << 20, f"malloc_trim returned {returned >> 20} MiB of 64 freed"


def test_the_engine_returns_its_build_s_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(hybrid.engine, "trim_freed_memory", calls.append)
    topology = Topology.build(1)
    parallel = TensorParallel.from_topology(topology, 0)
    config = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=64)
    model = GPT(config, parallel, seed=0)
    engine = Engine(model, topology, parallel, EngineConfig(), units=list(model.blocks))
    assert calls == [engine.device]  # once, after everything the build allocates
