"""QueuedDeltaStream: one request's deltas through an asyncio queue, for any engine client.

The producer (the AsyncEngine's loop, or the ReplicaSet's reader of a replica's frames)
`put`s deltas; the reader iterates until the finished one. Closing before that calls
`on_close(request_id)` once: the owner aborts the request there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from daemon.engine.outputs import Delta


class QueuedDeltaStream:
    """A DeltaStream (daemon/engine/client.py) fed by `put`; `close()` early calls `on_close`."""

    __slots__ = ("_on_close", "finished", "queue", "request_id")

    def __init__(self, request_id: str, on_close: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        # True once the reader took the finished delta (or closed the stream).
        self.finished = False
        self._on_close = on_close

    def __aiter__(self) -> QueuedDeltaStream:
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

    def pending(self) -> int:
        """Deltas put and not read yet."""
        return self.queue.qsize()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._on_close(self.request_id)
