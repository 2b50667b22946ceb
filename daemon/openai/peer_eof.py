"""A client's EOF during a generation: which answers survive it.

A half-close (shutdown(SHUT_WR) after sending the request) and a client that closed its
socket both arrive as one FIN; only a write tells them apart: a socket that is really
closed answers the first write with RST, and the write after it fails, which closes the
connection and cancels the handler (the request is aborted, its KV blocks freed). The
connection (daemon/service/http_protocol.py) keeps writing after EOF and marks it in
`peer_eof`; then

- a streamed answer goes on: it writes every token, so a client that is really gone is
  noticed within two writes of the EOF (its headers count as one). A client that left
  while its request was still queued is noticed at the first token or two (queue time and
  prefill still run for it);
- a non-streamed generation writes nothing until its end and cannot tell: were it kept,
  every client that gave up would hold its KV blocks to the end. `ends_at_eof` ends it at
  EOF, as aiohttp's default close does: a half-closed client gets no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from aiohttp import web


@contextlib.contextmanager
def ends_at_eof(request: web.BaseRequest, applies: bool = True) -> Iterator[None]:
    """While inside, EOF from the client closes the connection (its handler is cancelled).

    A connection without `peer_eof` (not ours) closes itself at EOF anyway.
    """
    eof: asyncio.Future[None] | None = getattr(request.protocol, "peer_eof", None)
    if not applies or eof is None:
        yield
        return

    def close(_: asyncio.Future[None]) -> None:
        transport = request.transport
        if transport is not None:
            transport.close()

    eof.add_done_callback(close)  # run soon if the EOF came already
    try:
        yield
    finally:
        eof.remove_done_callback(close)
