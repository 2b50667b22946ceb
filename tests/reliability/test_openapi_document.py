"""/openapi.json is valid OpenAPI 3.1 and says what the server does (issue 25 item 10)."""

from __future__ import annotations

import jsonschema
from openapi_spec_validator import validate
from reliability_fixtures import api_client

from daemon.openai.extra_endpoints import openapi_document
from daemon.openai.protocol import MAX_STOP

DOC = openapi_document()
SCHEMAS = DOC["components"]["schemas"]
CHAT = [{"role": "user", "content": "Hi"}]


def valid(name: str, body: object) -> bool:
    return jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(body)


def test_document_is_valid_openapi_3_1():
    assert DOC["openapi"] == "3.1.0"
    validate(DOC)  # raises on any error


async def test_document_and_server_agree(tiny):
    cases = [
        # (endpoint, schema, body)
        ("/tokenize", "TokenizeRequest", {}),
        ("/tokenize", "TokenizeRequest", {"prompt": "a", "model": None}),
        ("/v1/completions", "CompletionRequest", {"prompt": "a", "model": None, "max_tokens": 1}),
        ("/v1/completions", "CompletionRequest", {"prompt": "a", "stop": ["x"] * MAX_STOP}),
        ("/v1/completions", "CompletionRequest", {"prompt": "a", "stop": ["x"] * (MAX_STOP + 1)}),
        ("/v1/completions", "CompletionRequest", {"prompt": "a", "stream_options": {}}),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [{"role": "tool", "content": "4"}], "max_tokens": 1},
        ),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": CHAT, "max_tokens": 1}),
    ]
    async with api_client(tiny) as (client, _):
        for path, schema, body in cases:
            r = await client.post(path, json={**body, "max_tokens": 1} if "stop" in body else body)
            accepted = r.status == 200
            assert accepted == valid(schema, body), (path, body, r.status, await r.text())
