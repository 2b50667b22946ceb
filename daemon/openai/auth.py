"""Access control: a bearer API key on every route but /health; /metrics on the Unix socket.

The Unix socket itself is guarded by its file mode and group (see daemon/service/server.py); a key,
when set, is required there too, so one rule holds whatever the transport.
"""

from __future__ import annotations

import hmac
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from daemon.openai.errors import Handler
from daemon.openai.protocol import APIError

OPEN_PATHS = frozenset({"/health"})
# Where the middleware leaves the matched key's name (typed keys since aiohttp 3.12).
API_KEY_NAME: Any = (
    web.RequestKey("api_key_name", str) if hasattr(web, "RequestKey") else "api_key_name"
)


def load_api_keys(key: str | None, key_file: str | None) -> dict[str, str | None]:
    """The accepted keys, each with the tenant it names (None: unnamed); empty: open.

    --api-key (or HEADRACE_API_KEY) is one unnamed key; else --api-key-file holds a key a
    line, `KEY` or `NAME KEY` (requests with that key are tenant NAME unless they say
    otherwise); blank lines and `#` comments are skipped. A one-line file reads as before.
    """
    if key:
        return {key: None}
    if key_file:
        keys: dict[str, str | None] = {}
        for lineno, line in enumerate(Path(key_file).read_text().splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) > 2:
                raise ValueError(f"api_key_file: {key_file}:{lineno}: expected KEY or NAME KEY")
            keys[fields[-1]] = fields[0] if len(fields) == 2 else None
        if not keys:
            raise ValueError(f"api_key_file: {key_file} is empty")
        return keys
    env = os.environ.get("HEADRACE_API_KEY")
    return {env: None} if env else {}


def load_api_key(key: str | None, key_file: str | None) -> str | None:
    """The first accepted key (see load_api_keys), or None when the server is open."""
    return next(iter(load_api_keys(key, key_file)), None)


def is_unix_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def access(api_keys: Mapping[str, str | None] | str | None, metrics_unix_only: bool):
    """The middleware: 401 without a right key, 403 for /metrics over TCP when limited.

    The matched key's name, if it has one, is left in `request[API_KEY_NAME]`.
    """
    if isinstance(api_keys, str):
        api_keys = {api_keys: None}
    expected = [(k.encode(), name) for k, name in (api_keys or {}).items()]

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if expected:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            given = token.strip().encode()
            # compare_digest, against every key: the time taken tells neither how much of a
            # key matched nor which one.
            matched = [name for key, name in expected if hmac.compare_digest(given, key)]
            if scheme.lower() != "bearer" or not matched:
                raise APIError(
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    kind="authentication_error",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if matched[0] is not None:
                request[API_KEY_NAME] = matched[0]
        if metrics_unix_only and request.path == "/metrics" and not is_unix_socket(request):
            raise APIError(
                403, "/metrics is served on the Unix socket only", kind="permission_error"
            )
        return await handler(request)

    return middleware
