"""Hand the heap memory a load freed back to the OS.

Loading converts every weight at least once (the checkpoint's blocks dequantised to floats,
then packed into each kernel's layout, some formats freed again), in allocations of a few MB
each. glibc serves those from its arenas once its mmap threshold has grown past them, and
`free` keeps the pages: on Zen 1 the embedded SmolLM2 engine held 0.3 GB it no longer used
after loading, 0.6 GB once the formats no step reads were freed too (docs/performance.md,
seventh session). `malloc_trim` returns whole free pages from every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def trim_heap() -> int:
    """Return the heap's free pages to the OS; the bytes the resident set shrank by (0 where
    the C library has no malloc_trim, i.e. is not glibc, or nothing was free)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return 0
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is None:
        return 0
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    before = resident_bytes()
    trim(0)
    return max(0, before - resident_bytes())
