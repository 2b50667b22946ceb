"""A shared-memory broadcast ring: one writer (rank 0), N-1 readers (the workers).

```
int64 words:  [published] [consumed_1 .. consumed_{N-1}]    counters
slots:        slot i = [nbytes int64][payload ...]           message m lives in slot m % slots
```
The writer fills slot `published % slots` once every reader has consumed the message that
was there, then bumps `published`; reader r copies message `consumed_r` out, then bumps
`consumed_r`. Each counter has one writer, so no lock is needed.

NOTE: the counters are aligned int64 stores; x86's total store order makes a payload
visible before the counter written after it. A weakly ordered CPU would need fences here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

_SLOT_HEADER = 8


class RingTimeout(TimeoutError):
    """A peer did not keep up within the deadline (dead or hung)."""


def spin_wait(ready: Callable[[], bool], deadline: float | None, alive: Callable[[], bool]) -> None:
    """Spin briefly (a step follows a step within microseconds), then yield, then sleep:
    an idle ring costs next to nothing, and the first step after idle waits <= 1 ms."""
    spins = 0
    start = time.monotonic()
    while not ready():
        spins += 1
        if spins < 2000:
            continue
        now = time.monotonic()
        if spins % 64 == 0:
            if deadline is not None and now > deadline:
                raise RingTimeout("shared-memory ring: peer did not keep up")
            if not alive():
                raise RingTimeout("shared-memory ring: peer is gone")
        if now - start < 0.05:
            os.sched_yield()
        else:
            time.sleep(0.001)


class ShmRing:
    """See the module docstring. `create` on rank 0, `attach(name, reader)` on worker r."""

    def __init__(
        self, shm: shared_memory.SharedMemory, readers: int, slots: int, slot_bytes: int
    ) -> None:
        self.shm, self.readers, self.slots, self.slot_bytes = shm, readers, slots, slot_bytes
        self._counters = np.ndarray((1 + readers,), np.int64, shm.buf, 0)
        self._base = 8 * (1 + readers)

    @classmethod
    def create(cls, readers: int, slot_bytes: int, slots: int = 4) -> ShmRing:
        size = 8 * (1 + readers) + slots * (slot_bytes + _SLOT_HEADER)
        ring = cls(shared_memory.SharedMemory(create=True, size=size), readers, slots, slot_bytes)
        ring._counters[:] = 0
        return ring

    @classmethod
    def attach(cls, name: str, readers: int, slots: int, slot_bytes: int) -> ShmRing:
        # NOTE: spawned workers share the creator's resource tracker, so attaching registers
        # nothing new; the creator unlinks the segment once (close(unlink=True)).
        shm = shared_memory.SharedMemory(name=name)
        return cls(shm, readers, slots, slot_bytes)

    @property
    def name(self) -> str:
        return self.shm.name

    def _slot(self, m: int) -> int:
        return self._base + (m % self.slots) * (self.slot_bytes + _SLOT_HEADER)

    def write(
        self, words: np.ndarray, timeout: float, alive: Callable[[], bool] = lambda: True
    ) -> None:
        """Publish one message (int32 words) to every reader."""
        data = words.view(np.uint8)
        if data.nbytes > self.slot_bytes:
            raise ValueError(
                f"step message of {data.nbytes} bytes exceeds the ring's {self.slot_bytes}"
            )
        m = int(self._counters[0])
        consumed = self._counters[1:]
        spin_wait(lambda: int(consumed.min()) > m - self.slots, time.monotonic() + timeout, alive)
        at = self._slot(m)
        buf = self.shm.buf
        np.ndarray((1,), np.int64, buf, at)[0] = data.nbytes
        buf[at + _SLOT_HEADER : at + _SLOT_HEADER + data.nbytes] = data.tobytes()
        self._counters[0] = m + 1

    def read(self, reader: int, alive: Callable[[], bool] = lambda: True) -> np.ndarray:
        """The next message for reader `reader` (1-based), as int32 words (a copy)."""
        m = int(self._counters[reader])
        spin_wait(lambda: int(self._counters[0]) > m, None, alive)
        at = self._slot(m)
        nbytes = int(np.ndarray((1,), np.int64, self.shm.buf, at)[0])
        words = np.frombuffer(self.shm.buf, np.int32, nbytes // 4, at + _SLOT_HEADER).copy()
        self._counters[reader] = m + 1
        return words

    def close(self, unlink: bool = False) -> None:
        # The numpy views hold exports of the buffer: drop them before closing.
        self._counters = None  # type: ignore[assignment]
        self.shm.close()
        if unlink:
            self.shm.unlink()
