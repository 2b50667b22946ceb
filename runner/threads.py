"""Thread settings for the CPU forward. Torch-free: call `set_openmp_defaults` before torch
is imported, since libgomp reads its environment once, when torch loads it.

Rule (held on both 2-core machines measured, Zen3 and Sapphire Rapids; see README):
all cores to the forward, with idle OpenMP workers sleeping instead of spinning.
- A spinning libgomp team (the default OMP_WAIT_POLICY spins ~300k rounds before sleeping)
  fights the event loop or a neighbour for a core: a step slowed up to 20x on Zen3.
  PASSIVE makes idle workers sleep at once; the wake-up costs microseconds per parallel
  region, far less than a lost time slice.
- With PASSIVE, the event loop (which needs a few percent of a core while streaming) shares
  the cores without stalling the team, so the forward gets every core.
"""

from __future__ import annotations

import os


def set_openmp_defaults() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user chose otherwise."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads() -> int:
    """Torch intra-op threads when the user gives none: every core we may use."""
    return available_cores()
