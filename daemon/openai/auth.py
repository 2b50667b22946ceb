"""Access control: a bearer API key on every route but /health; /metrics on the Unix socket.

The Unix socket itself is guarded by its file mode and group (see daemon/service/server.py); a key,
when set, is required there too, so one rule holds whatever the transport.
"""

from __future__ import annotations

import hmac
import os
import socket
from pathlib import Path

from aiohttp import web

from daemon.openai.errors import Handler
from daemon.openai.protocol import APIError

OPEN_PATHS = frozenset({"/health"})


def load_api_key(key: str | None, key_file: str | None) -> str | None:
    """--api-key (or HEADRACE_API_KEY), else the first line of --api-key-file; None: open."""
    if key:
        return key
    if key_file:
        text = Path(key_file).read_text().strip()
        if not text:
            raise ValueError(f"api_key_file: {key_file} is empty")
        return text.splitlines()[0].strip()
    return os.environ.get("HEADRACE_API_KEY") or None


def is_unix_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def access(api_key: str | None, metrics_unix_only: bool):
    """The middleware: 401 without the right key, 403 for /metrics over TCP when limited."""
    expected = api_key.encode() if api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if expected is not None:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            # compare_digest: the time taken does not tell how much of the key matched.
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), expected
            ):
                raise APIError(
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    kind="authentication_error",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if metrics_unix_only and request.path == "/metrics" and not is_unix_socket(request):
            raise APIError(
                403, "/metrics is served on the Unix socket only", kind="permission_error"
            )
        return await handler(request)

    return middleware
