"""runner/heap.py: the load's freed heap pages go back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import pytest

from runner.heap import resident_bytes, trim_heap

GLIBC = sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None


def test_resident_bytes_sees_memory_being_touched():
    # A fresh mapping, not the heap: a long-lived process may hold freed pages still resident.
    with mmap.mmap(-1, 64 << 20) as block:
        before = resident_bytes()
        block.write(b"\x01" * (64 << 20))  # every page written
        assert resident_bytes() - before > 48 << 20


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_chunks_below_the_heap_top_are_returned():
    # 64 KiB chunks come from the heap (below the 128 KiB mmap threshold); one kept at the
    # end pins the top, so `free` alone returns nothing, as with a load's freed weights.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(64 << 10) for _ in range(1600)]  # 100 MiB
    for p in chunks:
        ctypes.memset(p, 1, 64 << 10)
    for p in chunks[:-1]:
        libc.free(p)
    try:
        assert trim_heap() > 64 << 20
        assert trim_heap() < 8 << 20  # nothing much left to return
    finally:
        libc.free(chunks[-1])
