"""aiohttp's connection handling with our limits: a connection cap, JSON protocol errors
that never echo (or log) a header, and a client's EOF handed to the request it ends.

- Idle and slow connections: aiohttp's keep-alive timer (`keepalive_timeout`) starts when
  a connection opens and closes it while no complete request has arrived, so it bounds a
  client that sends nothing, partial headers, or nothing after its last answer.
- Over `max_connections` open connections a new one is answered 503 (JSON, Connection:
  close) to its first request, without reaching the app.
- Protocol errors (a malformed request line or header) are answered before any handler
  runs; aiohttp answers them text/plain and logs the exception, whose text holds the
  offending bytes (`Authorization: Bearer secret\\x00`). Here: the JSON error shape, and a
  log line with the status and the error's class only.
- EOF from the client (a FIN) after whole requests keeps the connection open for writing
  and sets `peer_eof`; the request decides (daemon/openai/peer_eof.py): a streamed answer
  goes on (a half-closed client gets all of it), a non-streamed generation ends, as at
  aiohttp's default close. A FIN in the middle of a request, or on an idle connection,
  closes it at once as before. Nothing is read after a FIN, so the connection closes once
  the requests it carried are answered.

Tested on aiohttp 3.14 (the private hooks used: Server.__call__, AppRunner._make_server).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from daemon.openai.errors import RETRY_AFTER_S, json_response
from daemon.openai.protocol import APIError

log = logging.getLogger("headrace.http")


class GuardedRequestHandler(RequestHandler):
    """One connection; see the module docstring."""

    # Done when the client has sent EOF after whole requests (daemon/openai/peer_eof.py).
    peer_eof: asyncio.Future[None]

    def connection_made(self, transport: Any) -> None:
        server = self._manager
        if isinstance(server, GuardedServer) and server.full():
            self._request_handler = _over_capacity
        self.peer_eof = self._loop.create_future()
        super().connection_made(transport)

    def eof_received(self) -> bool:
        self.close()  # nothing can follow a FIN: end after the requests already here
        current = self._current_request
        bodies = [payload for _, payload in self._messages]
        bodies += [current.content] if current is not None else []
        # start() is not waiting for a message: it has taken one (its task may not run yet).
        taken = self._waiter is None and self._request_count > 0
        answering = self._request_in_progress or taken or bool(self._messages)
        if not answering or not all(body.is_eof() for body in bodies):
            return False  # idle, or a request cut short: the transport closes itself
        if not self.peer_eof.done():
            self.peer_eof.set_result(None)
        return True  # keep the write side open: the requests decide

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # NOTE: never log `exc` or `message`: both carry the raw request bytes.
        log.warning(
            "HTTP %d before any handler ran (%s)", status, type(exc).__name__ if exc else "-"
        )
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; cannot send an error")
        if status >= 500:
            error = APIError(status, "internal error", kind="server_error")
        else:
            what = type(exc).__name__ if exc else "bad request"
            error = APIError(status, f"malformed HTTP request ({what})")
        resp = json_response(error.body(), status)
        resp.force_close()
        return resp


async def _over_capacity(request: BaseRequest) -> web.StreamResponse:
    error = APIError(
        503,
        "too many open connections (--max-connections); retry later",
        kind="unavailable",
        headers={"Retry-After": RETRY_AFTER_S},
    )
    resp = json_response(error.body(), 503, error.headers)
    resp.force_close()
    return resp


class GuardedServer(Server):
    """aiohttp's protocol factory, making GuardedRequestHandlers; `max_connections` 0 is
    unbounded."""

    max_connections: int = 0

    def full(self) -> bool:
        return 0 < self.max_connections <= len(self._connections)

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """web.AppRunner whose server is a GuardedServer."""

    def __init__(self, app: web.Application, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # NOTE: the app builds its Server itself (request factory, access log); swapping
        # the class keeps all of that and changes only the protocol it makes.
        server.__class__ = GuardedServer
        assert isinstance(server, GuardedServer)
        server.max_connections = self.max_connections
        return server
