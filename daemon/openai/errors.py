"""Every 4xx/5xx as the OpenAI error shape, request body limits, and SSE error events.

```
{"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": 400}}
```
aiohttp's own answers (404 no route, 405 wrong method, 413 body too large) are plain text;
the middleware here rewrites them, so a client parses one shape whatever went wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from daemon.openai.protocol import APIError

log = logging.getLogger("headrace.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The finish reasons the OpenAI API defines; anything else never reaches a client as one.
OPENAI_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter"})
# The stop reason of the requests a drain ends (daemon/service/shutdown.py): a 503.
SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_S = "1"

_KIND_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def json_response(
    data: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def error_response(e: APIError) -> web.Response:
    return json_response(e.body(), e.status, e.headers)


def failure(stop_reason: object) -> APIError:
    """The error for a request that ended without an OpenAI finish reason."""
    if stop_reason == SHUTTING_DOWN:
        return APIError(
            503, SHUTTING_DOWN, kind="unavailable", headers={"Retry-After": RETRY_AFTER_S}
        )
    return APIError(500, f"generation failed: {stop_reason}", kind="server_error")


def from_http_exception(e: web.HTTPException) -> APIError:
    """aiohttp's HTTPNotFound, HTTPMethodNotAllowed, ... as an APIError of the same status."""
    kind = _KIND_BY_STATUS.get(
        e.status, "server_error" if e.status >= 500 else "invalid_request_error"
    )
    message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    headers = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
    return APIError(e.status, message, kind=kind, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """APIError, aiohttp's HTTP errors and unexpected exceptions -> the JSON error shape."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(from_http_exception(e))
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return error_response(APIError(500, "internal error", kind="server_error"))


def body_limit(max_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    """413 from the Content-Length header, before a byte of the body is read.

    A chunked body has no length up front: aiohttp's `client_max_size` (set to the same
    limit) stops reading it once it passes the limit, and json_errors shapes that 413.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes:
            raise APIError(
                413,
                f"body: {length} bytes exceed the limit of {max_bytes} (--max-request-bytes)",
                kind="invalid_request_error",
            )
        return await handler(request)

    return middleware
