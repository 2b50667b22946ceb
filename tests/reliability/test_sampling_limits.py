"""Issue 25 items 6, 7, 11: degenerate numbers answer 400 naming the field, or are clamped
(documented in docs/api.md) so that the sampler never sees a value it turns into NaN."""

from __future__ import annotations

import json

from reliability_fixtures import api_client

CHAT = [{"role": "user", "content": "Hi"}]
DEEP = 300


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


async def post(client, path, body):
    # The stdlib writes integers beyond 64 bits, as clients can.
    r = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
    return r.status, await r.json()


REFUSED = [
    # (path, body, the field the 400 must name)
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**63 + 5}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**40}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-320}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e300}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": nested(DEEP)}, "guided_json"),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": nested(DEEP)},
            },
        },
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 30},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
]


async def test_degenerate_values_answer_400_naming_the_field(tiny):
    async with api_client(tiny) as (client, _):
        for path, body, field in REFUSED:
            status, data = await post(client, path, body)
            assert status == 400, (body if field != "guided_json" else field, data)
            assert data["error"]["param"] == field, data
            assert field.split(".")[0] in data["error"]["message"], data


async def test_integers_beyond_64_bits_are_named_out_of_range_not_float(tiny):
    async with api_client(tiny) as (client, _):
        for key in ("seed", "top_k", "max_tokens", "n"):
            status, data = await post(client, "/v1/completions", {"prompt": "Hi", key: 2**64 + 1})
            assert status == 400 and data["error"]["param"] == key, data
            message = data["error"]["message"]
            assert "float" not in message and "out of range" in message, message


async def test_tiny_temperature_and_top_p_are_greedy_not_garbage(tiny):
    """temperature 1e-300 is greedy (below 1e-5, as vLLM); top_p 1e-320 keeps the top token."""
    base = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    async with api_client(tiny) as (client, _):
        _, greedy = await post(client, "/v1/completions", {**base, "temperature": 0})
        expected = greedy["choices"][0]["text"]
        assert expected
        for extra in ({"temperature": 1e-300}, {"top_p": 1e-320}, {"top_p": 1e-320, "seed": 3}):
            status, data = await post(client, "/v1/completions", {**base, **extra})
            assert status == 200, data
            choice = data["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"] == expected, extra
