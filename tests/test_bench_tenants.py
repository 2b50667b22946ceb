"""`bench serve --tenants`: parsing, assignment by share, the `user` field, per-tenant
figures over the all-backlogged window, and Jain's index."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from daemon.bench.client import Endpoint
from daemon.bench.results import RequestRecord
from daemon.bench.serve import RunOutcome, RunSpec, build_result, format_report
from daemon.bench.tenants import (
    TenantSpec,
    assign_tenants,
    backlogged_window,
    jain_index,
    summarize_tenants,
)
from daemon.bench.workloads import BenchRequest


def test_parse_and_errors() -> None:
    specs = TenantSpec.parse_list("heavy:10, a:1,b")
    assert specs == [TenantSpec("heavy", 10.0), TenantSpec("a", 1.0), TenantSpec("b", 1.0)]
    for bad in ("a:0", ":1", "a:x", "a:1,a:2"):
        with pytest.raises(ValueError, match="--tenants"):
            TenantSpec.parse_list(bad)


def test_requests_follow_the_shares_and_carry_user() -> None:
    reqs = [BenchRequest("hi", None, 1, 4) for _ in range(1300)]
    assign_tenants(reqs, TenantSpec.parse_list("heavy:10,a:1,b:1,c:1"), seed=3)
    counts = Counter(r.tenant for r in reqs)
    assert 900 <= counts["heavy"] <= 1100
    assert all(60 <= counts[t] <= 140 for t in "abc")
    assert Endpoint("http://127.0.0.1:1").body(reqs[0])["user"] == reqs[0].tenant
    assert "user" not in Endpoint("http://127.0.0.1:1").body(BenchRequest("x", None, 1, 1))


def test_jain_index() -> None:
    assert jain_index([5.0, 5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(jain_index([0.0, 0.0]))


def rec(tenant: str, start: float, chunks: list[float], tokens: int) -> RequestRecord:
    return RequestRecord(start, 10, chunks, chunks[-1], tokens, tenant=tenant)


def test_per_tenant_rates_count_only_the_backlogged_window() -> None:
    # a's last request ends at 2.0: the window is [0, 2]; b streams on alone until 4.0.
    records = [
        rec("a", 0.0, [0.5, 1.0], 2),
        rec("a", 0.0, [1.5, 2.0], 2),
        rec("b", 0.0, [1.0, 2.0, 3.0, 4.0], 4),
    ]
    tenants = TenantSpec.parse_list("a:1,b:1")
    assert backlogged_window(records, ["a", "b"]) == (0.0, 2.0)
    summary = summarize_tenants(records, tenants, duration_s=4.0)
    per = summary["per_tenant"]
    assert per["a"]["backlogged_output_throughput"] == pytest.approx(2.0)  # 4 tokens / 2 s
    assert per["b"]["backlogged_output_throughput"] == pytest.approx(1.0)  # 2 of its 4
    assert per["b"]["output_throughput"] == pytest.approx(1.0)  # 4 tokens / 4 s overall
    assert summary["jain_index"] == pytest.approx(9 / 10)
    outcome = RunOutcome(records, 0.0, 4.0, None, None, None)
    result = build_result(outcome, RunSpec(), Endpoint("http://x:1"), None, [], {}, tenants)
    assert result["tenants"]["jain_index"] == pytest.approx(0.9)
    assert "Jain fairness index" in format_report(result)
