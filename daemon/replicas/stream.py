"""One request's deltas as the front door receives them from its replica."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from daemon.engine.outputs import Delta


class ReplicaStream:
    """A DeltaStream fed by the replica's reader task; `close()` early aborts the request."""

    def __init__(self, request_id: str, replica: int, on_close: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.replica = replica
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.finished = False
        self.first_seen = False
        self._on_close = on_close

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finished:
            self.finished = True
        return delta

    def put(self, delta: Delta) -> None:
        self.queue.put_nowait(delta)

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._on_close(self.request_id)
