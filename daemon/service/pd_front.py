"""A minimal prefill/decode front door: producer for the prompt, consumer for the stream.

```
client --POST /v1/completions (or chat)--> front door
            1. same body, max_tokens 1, not streamed --> producer (--kv-connector peer
               --kv-role producer): computes the prompt, keeps its KV blocks for a while
            2. the original body --> consumer (--kv-role consumer): pulls those blocks
               from the producer's KV address, decodes; its response (SSE or JSON) is
               relayed to the client as it comes
```
The producer's answer is only a signal: if it fails (down, 4xx, 5xx) the consumer still
gets the request and computes the prompt itself (slower, never wrong). Everything else
(/v1/models, /health) goes to the consumer. This is the front door between independent
instances (other hosts, over TCP); within one daemon the data-parallel router's P/D mode
(`serve --prefill-replicas K --decode-replicas M`, daemon/replicas/prefill_decode.py) does
the same over its replicas' channels, K producers and M consumers at once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("headrace.pd_front")

# Relayed from the consumer's response; hop-by-hop ones are aiohttp's business.
_KEEP_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")


class Upstream:
    """One instance's HTTP API, at http://host:port or unix:/path/to.sock."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        if address.startswith("unix:"):
            self._connector: aiohttp.BaseConnector = aiohttp.UnixConnector(address[5:])
            self.base = "http://localhost"
        else:
            self._connector = aiohttp.TCPConnector()
            self.base = address.rstrip("/")
        self.session = aiohttp.ClientSession(
            connector=self._connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s),
        )

    async def close(self) -> None:
        await self.session.close()


class PDFrontDoor:
    """Sends each completion to a producer (prompt only), then to a consumer (the answer)."""

    def __init__(self, producer: str, consumer: str, connect_timeout_s: float = 5.0) -> None:
        self.producer_address, self.consumer_address = producer, consumer
        self.connect_timeout_s = connect_timeout_s
        self.producer: Upstream | None = None
        self.consumer: Upstream | None = None
        self.num_prefill_failures = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.relay)
        app.router.add_post("/v1/chat/completions", self.relay)
        app.router.add_get("/v1/models", self.relay)
        app.router.add_get("/health", self.relay)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.producer = Upstream(self.producer_address, self.connect_timeout_s)
        self.consumer = Upstream(self.consumer_address, self.connect_timeout_s)

    async def _stop(self, app: web.Application) -> None:
        for upstream in (self.producer, self.consumer):
            if upstream is not None:
                await upstream.close()

    async def relay(self, request: web.Request) -> web.StreamResponse:
        assert self.producer is not None and self.consumer is not None
        body = await request.read() if request.method == "POST" else None
        headers = {k: v for k, v in request.headers.items() if k in ("Authorization",)}
        if body is not None:
            await self._prefill(request.path, body, headers)
        try:
            if body is not None:
                headers["Content-Type"] = "application/json"
            upstream = await self.consumer.session.request(
                request.method, self.consumer.base + request.path, data=body, headers=headers
            )
        except aiohttp.ClientError as e:
            raise web.HTTPBadGateway(text=f"consumer {self.consumer.address}: {e}") from None
        async with upstream:
            out = web.StreamResponse(
                status=upstream.status,
                headers={k: upstream.headers[k] for k in _KEEP_HEADERS if k in upstream.headers},
            )
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _prefill(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        """The prompt through the producer, so its KV is there when the consumer asks."""
        assert self.producer is not None
        try:
            data: dict[str, Any] = json.loads(body)
        except ValueError:
            return  # the consumer answers the 400
        if not isinstance(data, dict):
            return
        data = {**data, "max_tokens": 1, "stream": False, "n": 1}
        data.pop("stream_options", None)
        data.pop("max_completion_tokens", None)
        try:
            async with self.producer.session.post(
                self.producer.base + path, json=data, headers=headers
            ) as resp:
                await resp.read()
                ok = resp.status == 200
        except aiohttp.ClientError as e:
            log.warning("producer %s: %s; the consumer computes it", self.producer.address, e)
            ok = False
        if not ok:
            self.num_prefill_failures += 1


def run(producer: str, consumer: str, host: str, port: int, uds: str | None) -> None:
    """`headrace pd-front`: serve the front door until interrupted."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    front = PDFrontDoor(producer, consumer)
    if uds:
        web.run_app(front.app(), path=uds, access_log=None)
    else:
        web.run_app(front.app(), host=host, port=port, access_log=None)
