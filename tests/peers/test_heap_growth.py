"""The heap instrument of benchmarks/memory/heap_growth.py reads what malloc's main arena
holds resident: blocks malloc'd on the main thread show up in it once written."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from benchmarks.memory.heap_growth import heap_rss

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def test_heap_rss_follows_blocks_malloc_keeps_on_the_heap() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 * 1024, 256  # 16 MiB, each block under any mmap threshold
    libc.malloc_trim(0)  # free heap pages earlier tests left resident go back first
    before = heap_rss()
    blocks = [libc.malloc(block) for _ in range(count)]
    try:
        # Fresh heap pages are resident only once written: malloc writes one header per
        # block (a page of 16), so the untouched blocks hardly count, the filled ones do.
        untouched = heap_rss() - before
        for address in blocks:
            ctypes.memset(address, 1, block)
        grown = heap_rss() - before
    finally:
        for address in blocks:
            libc.free(address)
    assert before > 0
    assert untouched <= 0.25 * block * count, f"{untouched} bytes resident before writing"
    assert grown >= 0.9 * block * count, f"heap grew {grown} bytes for {block * count}"
