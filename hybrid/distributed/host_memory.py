"""Freed host memory goes back to the operating system (CPU runs on glibc).

glibc serves a large allocation with its own mmap and unmaps it on free, but only up to a
threshold that it raises to the size of each mmapped block freed (up to 32 MiB). After the
first ZeRO bucket is freed, every later bucket, gradient buffer and large activation comes
from the heap instead, where freed blocks stay resident between allocations of other sizes.
A stage-3 run then grows by about a model's worth of resident memory per step although the
live tensors stay the same (measured: a 12-layer d_model 768 GPT at dp=2, 1.5 -> 1.9 GB peak
RSS over 4 steps with constant live bytes; 1.25 -> 1.32 GB with a fixed threshold). Fixing
the threshold (which also turns its adjustment off) keeps blocks of 768 KiB and more as
their own mappings, so what is freed is released: the resident set follows the live tensors, as
the ZeRO memory formulas and the planner assume. The cost is a page fault per page of a
fresh large block, small against the matrix products that fill it.

768 KiB, not 1 MiB: a tp=2 rank of the 57M benchmark holds its attention activations and
their gradients in blocks of exactly 768 KiB. Under a 1 MiB threshold they come from the
heap, whose freed 768 KiB holes get split by small long-lived allocations, so new ones
extend the heap top for ~20 steps (benchmarks/memory/heap_growth.py: [heap] 136 -> 192 MiB,
step peak 823 MiB against DTensor TP's 796). glibc mmaps a block over the threshold only
when no free chunk fits and the heap would have to grow, so 768 KiB caps that growth
([heap] 128 MiB flat, step peak 781 vs 785 MiB). The CPU demo ran at 0.987x the 1 MiB
speed (median of 6 alternated pairs of 150 steps, range 0.958-1.043x: noise); the 57M
tp=2 job's step took 1.008x (median of 8 alternated pairs of jobs over two runs of
benchmarks/memory/threshold_speed.py, 0.948-1.403x: within this machine's noise; the page
faults of the blocks now mmapped) for 4.4% less peak RSS (464.7 against 486.2 MiB), and
it ran 0.855x DTensor TP's step, both under 768 KiB (benchmarks/speed/peer_speed.py, 6
rounds, 0.741-1.239x).

A lower threshold was measured and not kept: at 256 KiB a TP rank's 768 KiB activations
leave the heap too, and the tp=2 57M benchmark's peak RSS fell 494 -> 464 MB (456.5 MiB of
tensors at its peak either way), but the CPU demo (configs/tiny.yaml, whose activations are
about 512 KiB) ran at 12.9k and 13.3k against 16.9k and 17.4k tokens/s (150 steps each,
alternated): a page fault per page of every one.

Set `MALLOC_MMAP_THRESHOLD_` in the environment to choose another value; it is then left
alone. GPU memory has its own allocator and is not affected.

Transparent huge pages were measured and not turned on: a fresh 4 KiB page costs about
2 us (216 MB of fresh 24 MB blocks: 52.7k faults, 70 ms, against 10 ms to fill them
again), and torch's `THP_MEM_ALLOC_ENABLE=1` (c10 madvises blocks of 2 MiB and more
MADV_HUGEPAGE) cut that to 2.2k faults and 18-20 ms. It took the 57M benchmark's ZeRO
stage 0 at dp=2 from 0.984x to 0.952x DDP's step (benchmarks/speed/peer_speed.py, 6
rounds each), but the CPU demo ran at 23.1k and 23.2k against 24.4k and 24.7k tokens/s
without (150 steps, alternated), so it stays the user's choice: set the variable before
starting the job.

Nor for the engine's own gradient buffers alone, although they are what DDP does not
re-fault (its buckets persist; ours are freed after each step so that none lives through
forward): advising each fresh bucket buffer MADV_HUGEPAGE took 9 fresh 24 MiB blocks from
55k faults and 93 ms to 4.7k and 26 ms in isolation, and the 57M stage 0 job at dp=2 from
179k to 129k faults per step, but its step from 1672 ms (1.062x DDP) to 1924-2021 ms
(1.27x; peer_speed.py --groups 0 1 --widths 57m --precisions fp32, two runs, AMD EPYC).

What a build frees below the threshold stays in glibc's heap, resident, between blocks
that live on (the seeded init's 512 KiB chunks, the buckets' bookkeeping): `malloc_trim(0)`
hands every free page of the heaps back (since glibc 2.8, not only the top), so the engine
calls it once when built (`trim_freed_memory`). The 57M model in one process held 1.002x
and 1.003x the plain loop's peak RSS without it (tensors equal to the byte), 0.999x in three
runs with it (benchmarks/memory_breakdown.py --pairs 0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

import torch

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD_BYTES = 768 << 10  # see above: the 57M model's tp=2 attention blocks


@functools.cache
def _glibc_function(name: str) -> Any:
    """libc's `name` where the C library has it (glibc), else None (musl, macOS: none with
    glibc's meaning)."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library is not None else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 768 KiB in this process; False where there is no glibc
    (or the user set the threshold in the environment)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False
    mallopt = _glibc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))


def trim_freed_memory(device: torch.device) -> bool:
    """Return the free pages of glibc's heaps to the OS (see above); False where nothing was
    returned, there is no glibc, or `device`'s memory is not the host's."""
    malloc_trim = _glibc_function("malloc_trim") if device.type == "cpu" else None
    return malloc_trim is not None and bool(malloc_trim(0))
