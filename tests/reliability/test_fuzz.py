"""Property-based fuzzing of the request parser and handlers, in-process.

Bodies come from the daemon's own OpenAPI document (conforming, and mutated in one
place), plus arbitrary JSON and broken bytes, sent to every POST route of an app on a
tiny model. Never a 5xx, never a hang, every error in the JSON shape, and the KV pool
empty afterwards. HEADRACE_FUZZ_EXAMPLES raises the count (CI: 2,000 bodies, 4 at a
time, and 150 conformance cases).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_strategies import ANY_JSON, SchemaStrategies
from reliability_fixtures import api_client

from daemon.openai.extra_endpoints import openapi_document

EXAMPLES = int(os.environ.get("HEADRACE_FUZZ_EXAMPLES", "2000"))
DOC = openapi_document()
SCHEMAS = SchemaStrategies(DOC)
POSTS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
# A small engine: max_model_len 32 and at most 16 waiting sequences keep any valid
# request short (a larger batch answers 400, a full queue 429).
ENGINE = {"max_model_len": 32, "max_num_seqs": 16, "max_waiting": 16}
HANG_S = 30.0


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _dumps(body: Any) -> bytes:
    # The stdlib writes integers beyond 64 bits (orjson refuses them): clients can too.
    return json.dumps(body).encode()


def cases() -> st.SearchStrategy[tuple[str, bytes]]:
    per_path = []
    for path, schema in POSTS.items():
        bodies = st.one_of(
            SCHEMAS.conforming(_ref(schema)),
            SCHEMAS.mutated(_ref(schema)),
            SCHEMAS.mutated(_ref(schema)),
            ANY_JSON,
        )
        per_path.append(st.tuples(st.just(path), bodies.map(_dumps)))
        per_path.append(st.tuples(st.just(path), st.binary(max_size=40)))
    return st.one_of(per_path)


async def send(client, path: str, data: bytes) -> tuple[int, bytes, str]:
    r = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return r.status, await r.read(), r.content_type


def check(status: int, body: bytes, content_type: str) -> None:
    assert status < 500, body[:500]
    if status >= 400:
        assert content_type == "application/json", (status, body[:200])
        err = orjson.loads(body)["error"]
        assert isinstance(err["message"], str) and err["code"] == status and err["type"]
        assert "Traceback" not in err["message"]
    elif content_type == "text/event-stream":
        events = body.decode().strip().split("\n\n")
        assert events[-1] == "data: [DONE]", events[-3:]
        assert not any(e.startswith('data: {"error"') for e in events), events[-3:]


def run_property(tiny, strategy, examples: int, check_case) -> Counter:
    """Drive a hypothesis property on an in-process app; its loop outlives every example."""
    loop = asyncio.new_event_loop()
    ctx = api_client(tiny, **ENGINE)
    client, _ = loop.run_until_complete(ctx.__aenter__())
    statuses: Counter = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def prop(case):
        status = loop.run_until_complete(asyncio.wait_for(check_case(client, case), HANG_S))
        statuses[status] += 1

    try:
        prop()
    finally:
        # Leaving the context waits for idle and asserts the pool is empty.
        loop.run_until_complete(ctx.__aexit__(None, None, None))
        loop.close()
    return statuses


def test_fuzzed_bodies_never_5xx_never_hang_and_leak_nothing(tiny):
    statuses: Counter = Counter()

    async def one(client, batch):
        # A few bodies at once, as clients do: they share engine steps.
        results = await asyncio.gather(*(send(client, path, data) for path, data in batch))
        for status, body, content_type in results:
            check(status, body, content_type)
            statuses[status] += 1
        return len(batch)

    sent = run_property(tiny, st.lists(cases(), min_size=4, max_size=4), EXAMPLES // 4, one)
    print(f"fuzz: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) == sum(k * v for k, v in sent.items()) >= EXAMPLES
    assert statuses[200] > 0 and statuses[400] > 0  # both halves of the parser ran


def test_openapi_document_conformance(tiny):
    """Conforming requests to every operation answer one of its documented statuses."""
    operations = []
    for path, item in DOC["paths"].items():
        for method, op in item.items():
            operations.append((path, method, op))

    @st.composite
    def requests(draw):
        path, method, op = draw(st.sampled_from(operations))
        body = None
        if "requestBody" in op:
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            body = draw(SCHEMAS.conforming(schema))
        url = path.replace("{model_id}", draw(st.sampled_from(["tiny", "other"])))
        return url, method, op, body

    async def one(client, case):
        url, method, op, body = case
        r = await client.request(method, url, json=body)
        content = await r.read()
        assert str(r.status) in op["responses"], (url, r.status, content[:300])
        check(r.status, content, r.content_type)
        if r.status == 200 and r.content_type == "application/json":
            schema = SCHEMAS.resolve(
                op["responses"]["200"]["content"]["application/json"]["schema"]
            )
            data = orjson.loads(content)
            assert set(schema.get("required", ())) <= set(data), (url, data)
        return r.status

    statuses = run_property(tiny, requests(), max(150, EXAMPLES // 13), one)
    print(f"openapi: statuses {dict(sorted(statuses.items()))}")
    assert statuses[200] > 0
