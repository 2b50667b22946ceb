"""New endpoints, access control, metrics exposition, logprob bytes, prompts kept out of logs."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web
from reliability_fixtures import api_client

from daemon.openai.auth import load_api_key
from daemon.openai.options import APIOptions

CHAT = [{"role": "user", "content": "Hi there"}]


async def test_model_by_id_tokenize_detokenize_openapi(tiny):
    async with api_client(tiny) as (client, _):
        r = await client.get("/v1/models/tiny")
        assert r.status == 200 and (await r.json())["id"] == "tiny"
        r = await client.get("/v1/models/other")
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"

        r = await client.post("/tokenize", json={"prompt": "héllo 日本"})
        data = await r.json()
        assert data["count"] == len(data["tokens"]) > 0 and data["max_model_len"] == 256
        r = await client.post("/detokenize", json={"tokens": data["tokens"]})
        assert (await r.json())["prompt"] == "héllo 日本"
        r = await client.post("/tokenize", json={"messages": CHAT})
        chat_ids = (await r.json())["tokens"]
        assert len(chat_ids) > 5
        r = await client.post("/detokenize", json={"tokens": [10**9]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"
        r = await client.post("/tokenize", json={"prompt": "a", "messages": CHAT})
        assert r.status == 400
        r = await client.post("/tokenize", json={"text": "a"})
        assert r.status == 400 and "'text'" in (await r.json())["error"]["message"]

        doc = await (await client.get("/openapi.json")).json()
        assert doc["openapi"].startswith("3.") and "/tokenize" in doc["paths"]
        # Every route the app serves is in the document, and the other way round.
        served = {
            r.resource.canonical.replace("{model_id:.+}", "{model_id}")
            for r in client.app.router.routes()
            if r.method != "HEAD"
        }
        assert served == set(doc["paths"])


async def test_api_key_guards_every_route_but_health(tiny, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    key = load_api_key(None, str(key_file))
    assert key == "s3cret"
    async with api_client(tiny, options=APIOptions(api_key=key)) as (client, _):
        assert (await client.get("/health")).status == 200
        for path in ("/v1/models", "/metrics", "/openapi.json", "/v1/models/tiny"):
            r = await client.get(path)
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
            r = await client.get(path, headers={"Authorization": "Bearer wrong"})
            assert r.status == 401
            r = await client.get(path, headers={"Authorization": "Bearer s3cret"})
            assert r.status == 200, path
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status == 401
        r = await client.post(
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 1},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert r.status == 200


async def test_metrics_counters_content_type_and_unix_only(tiny, tmp_path):
    options = APIOptions(metrics_unix_only=True)
    async with api_client(tiny, options=options) as (client, api):
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status == 200
        r = await client.get("/metrics")
        assert r.status == 403 and (await r.json())["error"]["type"] == "permission_error"
        # The same app on a Unix socket serves it.
        runner = web.AppRunner(api.app())
        await runner.setup()
        path = str(tmp_path / "m.sock")
        await web.UnixSite(runner, path).start()
        try:
            connector = aiohttp.UnixConnector(path)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.get("http://localhost/metrics") as r,
            ):
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await r.text()
        finally:
            await runner.cleanup()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    counters = {name.removesuffix("_total") for name, kind in types.items() if kind == "counter"}
    for name in counters:
        assert f"\n{name}_total" in text
    assert {"headrace_preemptions", "headrace_prompt_tokens", "headrace_requests_finished"} <= (
        counters
    )
    assert 'headrace_requests_finished_total{finish_reason="length"} 1.0' in text


async def test_chat_logprob_bytes_are_the_tokens_own(tiny):
    """A token holding part of a UTF-8 character reports its raw bytes, not U+FFFD's."""
    async with api_client(tiny) as (client, api):
        tok = api.responses.token_bytes
        ids = tiny.tokenizer.encode("日本")
        pieces = [tok(i) for i in ids]
        assert b"".join(raw for _, raw in pieces) == "日本".encode()
        assert any(text.startswith("bytes:") for text, _ in pieces)  # a partial character
        body = {
            "messages": CHAT,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
            "temperature": 0,
        }
        data = await (await client.post("/v1/chat/completions", json=body)).json()
        for entry in data["choices"][0]["logprobs"]["content"]:
            assert entry["bytes"] != [239, 191, 189] or "\ufffd" not in entry["token"]
            assert len(entry["top_logprobs"]) == 3


async def test_prompts_stay_out_of_logs_unless_asked(tiny, caplog):
    secret = "the-launch-code-is-0000"
    caplog.set_level(logging.DEBUG)
    async with api_client(tiny) as (client, _):
        await client.post("/v1/completions", json={"prompt": secret, "max_tokens": 1})
        await client.post("/v1/completions", json={"prompt": secret, "max_token": 1})
    assert secret not in caplog.text
    caplog.clear()
    async with api_client(tiny, options=APIOptions(log_prompts=True)) as (client, _):
        await client.post("/v1/completions", json={"prompt": secret, "max_tokens": 1})
    assert secret in caplog.text


def test_access_and_limit_options_parse_from_flags_and_environment():
    from daemon.service.serve_config import parse_serve_args
    from daemon.service.server import api_options

    config = parse_serve_args(
        [
            "--metrics-unix-only",
            "--log-prompts",
            "--max-request-bytes",
            "1000",
            "--stream-timeout",
            "5",
        ],
        environ={"HEADRACE_API_KEY": "k1"},
    )
    opts = api_options(config.server)
    assert (opts.api_key, opts.metrics_unix_only, opts.log_prompts) == ("k1", True, True)
    assert (opts.max_request_bytes, opts.stream_timeout) == (1000, 5.0)
