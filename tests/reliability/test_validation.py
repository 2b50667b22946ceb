"""Every field checked before a request reaches the engine: each hole of issue 8 as a 400."""

from __future__ import annotations

import pytest
from reliability_fixtures import api_client

from daemon.openai import validation
from daemon.openai.options import APIOptions

CHAT = [{"role": "user", "content": "Hi"}]


async def post(client, path, body):
    r = await client.post(path, json=body)
    return r.status, await r.json()


BAD_COMPLETIONS = [
    # (body, status, the field the error must name)
    ({"prompt": "Hi", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ({"prompt": "Hi", "seed": 18446744073709551616}, 400, "seed"),
    ({"prompt": "Hi", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ({"prompt": "Hi", "stop_token_ids": [99999999]}, 400, "stop_token_ids"),
    ({"prompt": "Hi", "slo": {"ttft_ms": "fast"}}, 400, "slo.ttft_ms"),
    ({"prompt": "Hi", "slo": {"ttft_ms": True}}, 400, "slo.ttft_ms"),
    ({"prompt": "Hi", "max_token": 5}, 400, "max_token"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "Hi", "guided_json": 5}, 400, "guided_json"),
    ({"prompt": "Hi", "guided_regex": 7}, 400, "guided_regex"),
    ({"prompt": "Hi", "guided_choice": []}, 400, "guided_choice"),
    ({"prompt": "Hi", "guided_grammar": 3}, 400, "guided_grammar"),
    ({"prompt": "Hi", "structured_outputs": {"frobnicate": 1}}, 400, "structured_outputs"),
    ({"prompt": "Hi", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"prompt": "Hi", "echo": True}, 400, "echo"),
    ({"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "Hi", "tools": [{"type": "function"}]}, 400, "tools"),
]

BAD_CHAT = [
    ({"messages": CHAT, "max_completion_tokens": 0, "max_tokens": 5}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "Hi"}]}, 400, "messages"),
    ({"messages": [{"role": "function", "content": "Hi"}]}, 400, "messages"),
    ({"messages": CHAT, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": CHAT, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"messages": CHAT, "guided_json": {}, "guided_regex": "a"}, 400, "guided_regex"),
    ({"messages": CHAT, "prompt_logprobs": 0}, 400, "prompt_logprobs"),
    ({"messages": CHAT, "max_token": 3, "frobnicate": 1}, 400, "frobnicate"),
]


async def test_bad_completion_bodies_answer_400_naming_the_field(tiny):
    async with api_client(tiny) as (client, _):
        for body, status, field in BAD_COMPLETIONS:
            got, data = await post(client, "/v1/completions", body)
            assert got == status, (body, data)
            err = data["error"]
            assert err["param"] == field and field.split(".")[0] in err["message"], (body, err)
            assert err["type"] == "invalid_request_error" and err["code"] == 400
            assert "Traceback" not in err["message"] and "could not convert" not in err["message"]


async def test_bad_chat_bodies_answer_400_naming_the_field(tiny):
    async with api_client(tiny) as (client, _):
        for body, status, field in BAD_CHAT:
            got, data = await post(client, "/v1/chat/completions", body)
            assert got == status, (body, data)
            assert data["error"]["param"] in (field, "messages"), (body, data)
            if field != "messages":
                assert field in data["error"]["message"]


async def test_unknown_fields_are_all_named(tiny):
    async with api_client(tiny) as (client, _):
        _, data = await post(
            client, "/v1/chat/completions", {"messages": CHAT, "max_token": 3, "frobnicate": 1}
        )
        assert "'frobnicate'" in data["error"]["message"]
        assert "'max_token'" in data["error"]["message"]


async def test_no_op_defaults_of_optional_fields_are_accepted(tiny):
    """response_format text, empty tools, tool_choice none, null guided_json: no-ops."""
    async with api_client(tiny) as (client, _):
        body = {
            "messages": CHAT,
            "max_tokens": 2,
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "none",
            "guided_json": None,
            "prompt_logprobs": None,
        }
        status, data = await post(client, "/v1/chat/completions", body)
        assert status == 200, data
        assert data["choices"][0]["finish_reason"] in ("stop", "length")


async def test_max_completion_tokens_wins_over_max_tokens(tiny):
    async with api_client(tiny) as (client, _):
        body = {
            "messages": CHAT,
            "max_completion_tokens": 2,
            "max_tokens": 7,
            "ignore_eos": True,
        }
        status, data = await post(client, "/v1/chat/completions", body)
        assert status == 200 and data["usage"]["completion_tokens"] == 2


async def test_batch_larger_than_the_waiting_queue_is_400_not_429(tiny):
    async with api_client(tiny, max_waiting=4) as (client, _):
        status, data = await post(
            client, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}
        )
        assert status == 400 and "max-waiting" in data["error"]["message"]
        status, _ = await post(client, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1})
        assert status == 200


async def test_largest_seed_with_n_2_is_served(tiny):
    """seed + 1 would overflow a 64-bit generator seed: it wraps instead of failing."""
    async with api_client(tiny) as (client, _):
        body = {"prompt": "Hi", "seed": validation.SEED_MAX, "n": 2, "max_tokens": 3}
        status, data = await post(client, "/v1/completions", body)
        assert status == 200, data
        assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]


async def test_http_errors_are_json(tiny):
    async with api_client(tiny, options=APIOptions(max_request_bytes=1000)) as (client, _):
        r = await client.get("/v1/nowhere")
        assert r.status == 404 and (await r.json())["error"]["code"] == 404
        r = await client.get("/v1/completions")
        assert r.status == 405 and (await r.json())["error"]["type"] == "invalid_request_error"
        r = await client.post("/v1/completions", data=b"x" * 5000)
        assert r.status == 413 and "max-request-bytes" in (await r.json())["error"]["message"]
        assert r.content_type == "application/json"

        async def chunks():
            for _ in range(10):
                yield b"y" * 500

        # No Content-Length: aiohttp stops reading past the limit; still the JSON shape.
        r = await client.post("/v1/completions", data=chunks())
        assert r.status == 413 and (await r.json())["error"]["code"] == 413


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_allow_lists_match_the_openapi_document(endpoint):
    from daemon.openai.extra_endpoints import openapi_document

    schemas = openapi_document()["components"]["schemas"]
    name = "CompletionRequest" if endpoint == "completions" else "ChatCompletionRequest"
    assert set(schemas[name]["properties"]) == validation.FIELDS[endpoint]
