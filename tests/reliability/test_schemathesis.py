"""schemathesis over every operation of /openapi.json against the live API (issue 25).

Bodies drawn from the document itself (valid ones, positive mode): every answer must be
documented for its operation, carry the declared content type, match the declared response
schema, and never be a 5xx. Bounded: a few examples per operation, so CI stays fast.
"""

from __future__ import annotations

import asyncio
import os

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from reliability_fixtures import api_client
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from daemon.openai.extra_endpoints import openapi_document

EXAMPLES = int(os.environ.get("HEADRACE_SCHEMATHESIS_EXAMPLES", "25"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _probe(operation: schemathesis.APIOperation, base_url: str, failures: list[str]) -> int:
    """Draw up to EXAMPLES cases of one operation, call the server, check each answer."""
    calls = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def probe(case: schemathesis.Case) -> None:
        nonlocal calls
        response = case.call(base_url=base_url, timeout=60)
        calls += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except BaseException as e:  # schemathesis raises a failure group naming each check
            failures.append(f"{operation.label} {response.status_code}: {e}"[:600])

    probe()
    return calls


def _probe_every_operation(base_url: str) -> tuple[dict[str, int], list[str]]:
    schema = schemathesis.openapi.from_dict(openapi_document())
    failures: list[str] = []
    calls = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        calls[operation.label] = _probe(operation, base_url, failures)
    return calls, failures


async def test_schemathesis_finds_no_5xx_and_no_schema_mismatch(tiny) -> None:
    async with api_client(tiny) as (client, _):  # on exit: no leaked block, no stuck request
        base_url = str(client.make_url("")).rstrip("/")
        calls, failures = await asyncio.to_thread(_probe_every_operation, base_url)
    operations = sum(len(ops) for ops in openapi_document()["paths"].values())
    assert len(calls) == operations  # every operation was exercised
    assert sum(calls.values()) >= 2 * operations
    assert failures == []
