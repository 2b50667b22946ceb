"""LoRA adapters at the API: `model` names the base or an adapter, the adapters' model
cards (`parent` = the base, as vLLM lists them), and vLLM's runtime load/unload routes.

```
POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/srv/adapters/sql"}
POST /v1/unload_lora_adapter  {"lora_name": "sql"}
```
Both sit behind the API key like every route but /health, and answer 404 unless the daemon
runs with --enable-lora-runtime-updates. A bad file answers 400 naming it; the adapters
already served are untouched. An adapter unloaded while requests use it serves those to
the end; new requests naming it get 404.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from daemon.engine.client import AdapterInfo, EngineClient
from daemon.openai.errors import json_response
from daemon.openai.extra_endpoints import read_json
from daemon.openai.protocol import APIError

log = logging.getLogger("headrace.api")


class LoRAEndpoints:
    """Adapter names, cards and the runtime routes over one engine's adapters."""

    def __init__(
        self, engine: EngineClient, model_name: str, base_card: Callable[[], dict[str, Any]]
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.base_card = base_card  # () -> the base model's card

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def resolve(self, model: str | None) -> str | None:
        """The adapter a request's `model` names; None for the base. 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        names = [a.name for a in self.engine.adapters()]
        if model in names:
            return model
        served = ", ".join(repr(m) for m in [self.model_name, *names])
        raise APIError(
            404,
            f"model: {model!r} does not exist; this server serves {served}",
            "model",
            kind="not_found_error",
        )

    def cards(self) -> list[dict[str, Any]]:
        """The base's card, then one per adapter."""
        base = self.base_card()
        return [base, *(self._card(base, a) for a in self.engine.adapters())]

    def card(self, model_id: str) -> dict[str, Any] | None:
        return next((c for c in self.cards() if c["id"] == model_id), None)

    def _card(self, base: dict[str, Any], adapter: AdapterInfo) -> dict[str, Any]:
        return {**base, "id": adapter.name, "root": adapter.path, "parent": base["id"]}

    # -- runtime updates -----------------------------------------------------------------

    async def load(self, request: web.Request) -> web.Response:
        name, body = await self._name(request)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise APIError(400, "lora_path: expected the adapter's file or directory", "lora_path")
        try:
            adapter = await self.engine.load_adapter(name, path)
        except ValueError as e:
            param = "lora_name" if str(e).startswith("lora_name:") else "lora_path"
            raise APIError(400, str(e), param) from None
        return json_response(self._card(self.base_card(), adapter))

    async def unload(self, request: web.Request) -> web.Response:
        name, _ = await self._name(request)
        try:
            self.engine.unload_adapter(name)
        except LookupError as e:
            raise APIError(404, f"lora_name: {e}", "lora_name", kind="not_found_error") from None
        return json_response({"id": name, "object": "model", "deleted": True})

    async def _name(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        if not self.engine.info.lora_runtime_updates:
            raise APIError(
                404,
                "runtime LoRA updates are off (start the daemon with "
                "--enable-lora-runtime-updates)",
                kind="not_found_error",
            )
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "body: expected a JSON object")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "lora_name: expected the adapter's name", "lora_name")
        return name, body
