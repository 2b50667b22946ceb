"""Stopping a CPU step between decoder layers, for a request that must not wait for it.

On a CPU a step of background work runs tens of milliseconds, and an urgent prompt that
arrives meanwhile waits for the rest of it (on average half). The engine loop may instead
set this flag while the step runs (daemon/engine/async_engine.py); the forward reads it
before each layer (the fused decode op in C++ too) and gives the step up with
`StepInterrupted`. The step's KV is then half written, at positions the scheduler takes
back (scheduling/step_undo.py) and the next step writes again, with the same tokens.
"""

from __future__ import annotations

import torch


class StepInterrupted(Exception):
    """The forward stopped between layers because its StepInterrupt was set."""


class StepInterrupt:
    """One byte, set by the engine loop's thread and read by the runner's between layers.

    A uint8 tensor, so the fused C++ decode op reads the same byte (atomically) that
    Python reads through its numpy view; cleared by the loop before each step starts, so a
    request to stop only ever reaches the step it was meant for.
    """

    def __init__(self) -> None:
        self.flag = torch.zeros(1, dtype=torch.uint8)
        self._view = self.flag.numpy()

    def request(self) -> None:
        self._view[0] = 1

    def clear(self) -> None:
        self._view[0] = 0

    @property
    def requested(self) -> bool:
        return bool(self._view[0])

    def check(self) -> None:
        """Raise StepInterrupted if a stop was requested (called before each layer)."""
        if self._view[0]:
            raise StepInterrupted
