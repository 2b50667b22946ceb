"""The CPU a benchmark ran on: lscpu's model name and flags, printed with every result, and
the rate its threads read memory at (the roofline the memory-bound kernels are held to)."""

from __future__ import annotations

import subprocess
import time


def cpu_description() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "lscpu unavailable"
    keep = ("Model name", "CPU(s):", "Flags")
    return "\n".join(line for line in out.splitlines() if line.startswith(keep))


def read_bandwidth() -> float:
    """Bytes a second all threads read from memory: the best of a few sums over 512 MB."""
    import torch

    x = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best
