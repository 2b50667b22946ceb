"""When will capacity free? The Retry-After of a 429 from the recent completion rate."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class CapacityEstimate:
    """Finish times of the last `window` requests give a rate; Retry-After follows from it.

    A full waiting queue frees one place per finished request (a waiting one moves up), so
    the wait for `needed` places is about `needed / rate`. Bounded to [1, max_s] seconds:
    with no history yet the answer is 1 s, as before.
    """

    def __init__(
        self, window: int = 64, max_s: int = 60, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._finishes: deque[float] = deque(maxlen=window)
        self.max_s = max_s
        self.clock = clock

    def finished(self) -> None:
        self._finishes.append(self.clock())

    def rate(self) -> float | None:
        """Finished requests per second over the window, or None with too little history."""
        if len(self._finishes) < 2:
            return None
        span = self.clock() - self._finishes[0]
        return (len(self._finishes) - 1) / span if span > 0 else None

    def retry_after(self, needed: int) -> int:
        rate = self.rate()
        if rate is None or needed <= 0:
            return 1
        return max(1, min(self.max_s, math.ceil(needed / rate)))
