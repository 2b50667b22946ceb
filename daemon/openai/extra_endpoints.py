"""Endpoints beside generation: a model by id, /tokenize, /detokenize (vLLM's shapes), and
/openapi.json (the API document kept in the package, daemon/openai/openapi.json)."""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from daemon.openai.errors import json_response
from daemon.openai.protocol import APIError, parse_messages
from daemon.openai.tokenizing import Tokenizing
from daemon.openai.validation import ValidationError, check_fields, int_list


def openapi_document() -> dict[str, Any]:
    return orjson.loads(resources.files("daemon.openai").joinpath("openapi.json").read_bytes())


async def read_json(request: web.Request, timeout: float | None = None) -> Any:
    """The body as JSON; 408 when it has not all arrived within `timeout` seconds."""
    try:
        data = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise APIError(
            408, f"body: not received within {timeout:.0f}s (--body-timeout)", kind="timeout"
        ) from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"body: invalid JSON: {e}") from None


class ExtraEndpoints:
    """Model lookup, tokenizer round trips and the OpenAPI document."""

    def __init__(self, find_model: Any, tokenizing: Tokenizing, vocab_size: int, max_len: int):
        self.find_model = find_model  # model id -> its card (the base or an adapter), or None
        self.tokenizing = tokenizing
        self.vocab_size = vocab_size
        self.max_len = max_len
        self._openapi = orjson.dumps(openapi_document())

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/openapi.json", self.openapi)

    async def model(self, request: web.Request) -> web.Response:
        card = self.find_model(request.match_info["model_id"])
        if card is None:
            raise APIError(
                404,
                f"model: {request.match_info['model_id']!r} does not exist",
                "model",
                kind="not_found_error",
            )
        return json_response(card)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    def _checked(self, body: Any, endpoint: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise APIError(400, "body: expected a JSON object")
        try:
            check_fields(body, endpoint)
        except ValidationError as e:
            raise APIError(400, str(e), e.param) from None
        model = body.get("model")
        if model is not None and self.find_model(model) is None:
            raise APIError(404, f"model: {model!r} does not exist", "model", kind="not_found_error")
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """{"prompt": str, "add_special_tokens": bool} or {"messages": [...]} -> token ids."""
        body = self._checked(await read_json(request), "tokenize")
        if ("prompt" in body) == ("messages" in body):
            raise APIError(400, "body: give exactly one of prompt and messages", "prompt")
        if "messages" in body:
            ids = await self.tokenizing.chat(parse_messages(body))
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise APIError(400, "prompt: expected a string", "prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise APIError(400, "add_special_tokens: expected a boolean", "add_special_tokens")
            ids = await self.tokenizing.encode(prompt, add_special_tokens=special)
        return json_response(
            {"count": len(ids), "max_model_len": self.max_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """{"tokens": [int]} -> {"prompt": str}."""
        body = self._checked(await read_json(request), "detokenize")
        try:
            ids = int_list(body.get("tokens"), "tokens")
        except ValidationError as e:
            raise APIError(400, str(e), e.param) from None
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"tokens: id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                "tokens",
            )
        return json_response({"prompt": await self.tokenizing.decode(ids)})
