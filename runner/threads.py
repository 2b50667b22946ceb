"""How many threads the CPU forward may use. Torch-free.

Every core in the process's affinity mask; runner/thread_governor.py then decides, step by
step, whether the cores are really ours (see README, "Threads").
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads() -> int:
    """Torch intra-op threads when the user gives none: every core we may use."""
    return available_cores()
