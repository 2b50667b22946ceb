"""Tenants through the API: user > X-Tenant > the API key's name; per-tenant metrics;
token-rate limits answered 429 naming the tenant's limit; `fair` with weights in the engine."""

from __future__ import annotations

import pytest
from reliability_fixtures import api_client, make_engine

from daemon.engine.config import EngineConfig
from daemon.openai.auth import load_api_keys
from daemon.openai.options import APIOptions
from daemon.service.serve_config import parse_serve_args
from daemon.service.server import api_options
from scheduling.policies.fair import FairPolicy

BODY = {"prompt": "Hi", "max_tokens": 2}


def metric_lines(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name) :]] = float(value)
    return out


def test_key_file_names_tenants(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nalice k-alice\n\nk-anon\n")
    assert load_api_keys(None, str(path)) == {"k-alice": "alice", "k-anon": None}
    path.write_text("only-key\n")
    assert load_api_keys(None, str(path)) == {"only-key": None}
    path.write_text("a b c\n")
    with pytest.raises(ValueError, match="expected KEY or NAME KEY"):
        load_api_keys(None, str(path))
    path.write_text("alice k-alice\n")
    config = parse_serve_args(["--api-key-file", str(path), "--tenant-rate-limits", "a=10,*=5"])
    opts = api_options(config.server)
    assert opts.api_keys == {"k-alice": "alice"}
    assert opts.tenant_rate_limits == {"a": 10.0, "*": 5.0}


async def test_tenant_resolution_and_metrics(tiny) -> None:
    options = APIOptions(api_keys={"k-alice": "alice", "k-anon": None})
    async with api_client(tiny, options=options) as (client, _):
        alice = {"Authorization": "Bearer k-alice"}
        anon = {"Authorization": "Bearer k-anon"}
        cases = [
            (alice, BODY, "alice"),  # the key's name
            ({**alice, "X-Tenant": "team-b"}, BODY, "team-b"),  # the header beats the key
            ({**alice, "X-Tenant": "team-b"}, {**BODY, "user": "carol"}, "carol"),  # user wins
            (anon, BODY, "default"),  # nothing names one: the shared tenant
        ]
        for headers, body, _ in cases:
            r = await client.post("/v1/completions", json=body, headers=headers)
            assert r.status == 200, await r.text()
        r = await client.post("/v1/completions", json={**BODY, "user": "x" * 200}, headers=anon)
        assert r.status == 400 and (await r.json())["error"]["param"] == "user"
        text = await (await client.get("/metrics", headers=anon)).text()
    tokens = metric_lines(text, "headrace_tenant_tokens_total")
    for _, _, tenant in cases:
        assert tokens[f'{{kind="output",tenant="{tenant}"}}'] == 2.0
        assert tokens[f'{{kind="prompt",tenant="{tenant}"}}'] >= 1.0
    queued = metric_lines(text, "headrace_tenant_queue_time_seconds_count")
    assert queued['{tenant="alice"}'] == 1.0 and queued['{tenant="carol"}'] == 1.0


async def test_token_rate_limit_answers_429_with_the_tenants_limit(tiny) -> None:
    # a: 5 tokens/s with a 10 s burst = 50 tokens; each request takes prompt + 40.
    options = APIOptions(tenant_rate_limits={"a": 5.0})
    async with api_client(tiny, options=options) as (client, api):
        body = {"prompt": "Hi", "max_tokens": 40, "user": "a"}
        assert (await client.post("/v1/completions", json=body)).status == 200
        r = await client.post("/v1/completions", json=body)
        assert r.status == 429
        assert int(r.headers["Retry-After"]) >= 1
        message = (await r.json())["error"]["message"]
        assert "tenant 'a' is over its limit of 5 tokens/s" in message
        # Another tenant is not limited; too big a request for the burst is a 400.
        ok = await client.post("/v1/completions", json={**body, "user": "b"})
        assert ok.status == 200
        big = await client.post("/v1/completions", json={**body, "max_tokens": 100})
        assert big.status == 400 and (await big.json())["error"]["param"] == "max_tokens"
        text = await (await client.get("/metrics")).text()
        assert api.limiter.rate("a") == 5.0
    rejections = metric_lines(text, "headrace_tenant_rejections_total")
    assert rejections['{reason="rate_limit",tenant="a"}'] == 1.0


def test_fair_policy_with_weights_from_the_engine_config(tiny) -> None:
    engine = make_engine(tiny, policy="fair", tenant_weights="a=2,b=1")
    policy = engine.scheduler.policy
    assert isinstance(policy, FairPolicy) and policy.weights == {"a": 2.0, "b": 1.0}
    with pytest.raises(ValueError, match="tenant_weights: only the fair policy"):
        make_engine(tiny, policy="fcfs", tenant_weights="a=2")
    assert EngineConfig().tenant_weights is None
