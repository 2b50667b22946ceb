"""Compile jobs queued per client and handed to workers in turn, so no client starves another.

```
client A: [a1 a2 a3 a4]      take() -> a1, b1, c1, a2, b2, a3, ...  (round robin over clients
client B: [b1 b2]                      with work; FIFO within a client)
client C: [c1]
```
A client runs at most `per_client` jobs at once (the pool sets it below its worker count), so
however many grammars one client sends, a worker is left for the next client's first one.
Thread-safe; no xgrammar, no processes: the policy is tested on its own.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from grammars.spec import GrammarSpec


@dataclass(eq=False, slots=True)
class CompileJob:
    """One compile; requests for the same spec share it (`waiters` counts them)."""

    spec: GrammarSpec
    client: str
    future: Future[Any] = field(default_factory=Future)
    waiters: int = 1
    # Set by a worker when it takes the job (perf_counter): the time limit starts here.
    started: float | None = None

    @property
    def abandoned(self) -> bool:
        """Nobody waits for the result any more: a worker may stop compiling it."""
        return self.waiters <= 0


class FairQueue:
    """Per-client FIFO queues served round robin; see the module doc."""

    def __init__(self, per_client: int = 1) -> None:
        if per_client < 1:
            raise ValueError("per_client must be at least 1")
        self.per_client = per_client
        # Clients with queued jobs, in the order they are served next.
        self._queues: OrderedDict[str, deque[CompileJob]] = OrderedDict()
        self._running: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, job: CompileJob) -> None:
        with self._cond:
            self._queues.setdefault(job.client, deque()).append(job)
            self._cond.notify()

    def take(self, timeout: float | None = None) -> CompileJob | None:
        """The next job (blocking); None once closed or after `timeout` seconds."""
        with self._cond:
            while not self._closed:
                job = self._next()
                if job is not None:
                    return job
                if not self._cond.wait(timeout) and timeout is not None:
                    return None
            return None

    def _next(self) -> CompileJob | None:
        for client, queue in self._queues.items():
            if self._running[client] >= self.per_client:
                continue
            job = queue.popleft()
            del self._queues[client]
            if queue:
                self._queues[client] = queue  # back of the rotation
            self._running[client] += 1
            return job
        return None

    def done(self, job: CompileJob) -> None:
        """A worker finished `job` (compiled, failed or stopped): its client may run another."""
        with self._cond:
            self._running[job.client] -= 1
            if self._running[job.client] <= 0:
                del self._running[job.client]
            self._cond.notify_all()

    def remove(self, job: CompileJob) -> bool:
        """Take a queued job out (its waiters all left); False if a worker already has it."""
        with self._cond:
            queue = self._queues.get(job.client)
            if queue is None or job not in queue:
                return False
            queue.remove(job)
            if not queue:
                del self._queues[job.client]
            return True

    def close(self) -> list[CompileJob]:
        """Wake every worker to exit; the jobs still queued are returned (to be failed)."""
        with self._cond:
            self._closed = True
            left = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._cond.notify_all()
            return left

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())
