"""The stop path after SIGTERM: every await bounded, every client answered, exit in time.

```
SIGTERM -> STOPPING=1 (watchdog pings stop) -> listeners closed, new requests 503
        -> up to --drain-timeout for in-flight requests to finish
        -> the rest ended: each stream gets an SSE error event (503) + [DONE], each
           non-streamed request a 503 JSON                  (up to HANDLER_GRACE_S to write)
        -> connections closed, handlers still writing cancelled  (CLOSE_S)
        -> engine loop stopped without waiting for a forward in flight
   a timer started at SIGTERM ends the process at drain-timeout + LAST_RESORT_S whatever
   is left (a forward or a grammar compile that does not return)
```
The whole path takes at most drain-timeout + HANDLER_GRACE_S + CLOSE_S + a little;
systemd's TimeoutStopSec must exceed drain-timeout + LAST_RESORT_S.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from daemon.engine.client import EngineClient
from daemon.openai.api import APIServer
from daemon.openai.errors import SHUTTING_DOWN
from daemon.service.systemd import Notifier

log = logging.getLogger("headrace.server")

# After the ending deltas are queued: time for handlers to write them (error event, [DONE]).
HANDLER_GRACE_S = 1.5
# aiohttp's shutdown: wait this long for a handler, then cancel it; also the bound on
# closing the listeners and the app's cleanup.
CLOSE_S = 1.0
# Past drain-timeout + this, the process exits whatever is still running.
LAST_RESORT_S = 4.5


@dataclass(slots=True)
class Stoppable:
    """What the stop path needs to reach."""

    api: APIServer
    engine: EngineClient
    runner: web.AppRunner
    sites: Sequence[web.BaseSite]
    notifier: Notifier


async def drain_and_stop(parts: Stoppable, drain_timeout: float) -> None:
    """Run the whole stop path; returns once the engine loop is stopped."""
    last_resort = LastResort(drain_timeout + LAST_RESORT_S)
    last_resort.start()
    engine, api = parts.engine, parts.api
    log.info("stopping: draining %d in-flight requests", engine.num_in_flight_requests)
    parts.notifier.stopping("draining")
    api.draining = True
    for site in parts.sites:
        await _bounded(site.stop(), CLOSE_S, "closing a listener")
    deadline = time.monotonic() + drain_timeout
    while engine.num_in_flight_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    ended = engine.end_all(SHUTTING_DOWN)
    if ended:
        log.warning("drain timeout (%.1fs) passed: ended %d requests", drain_timeout, ended)
    grace = time.monotonic() + HANDLER_GRACE_S
    while api.active and time.monotonic() < grace:
        await asyncio.sleep(0.02)
    # Closes idle connections, cancels handlers still blocked on a client that does not
    # read, runs the app's cleanup.
    await _bounded(parts.runner.cleanup(), 3 * CLOSE_S, "closing connections")
    await _bounded(engine.stop(wait=False), CLOSE_S, "stopping the engine loop")
    last_resort.finished = True


async def _bounded(awaitable: object, timeout: float, what: str) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)  # type: ignore[arg-type]
    except TimeoutError:
        log.warning("stopping: %s took over %.1fs; going on", what, timeout)


class LastResort(threading.Thread):
    """Ends the process `after` seconds from its start, from outside the event loop.

    Exit 0 when the stop path finished (only threads that outlive it, a forward or a
    grammar compile, were left), 1 when the stop path itself did not finish.
    """

    def __init__(self, after: float) -> None:
        super().__init__(name="headrace-last-resort", daemon=True)
        self.after = after
        self.finished = False

    def run(self) -> None:
        time.sleep(self.after)
        if self.finished:
            log.warning("stopped, but threads were still busy %.1fs after SIGTERM", self.after)
        else:
            log.error("the stop path did not end within %.1fs of SIGTERM; exiting", self.after)
        logging.shutdown()
        os._exit(0 if self.finished else 1)
