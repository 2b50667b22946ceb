"""Tenants in the daemon: resolution order, weights, token-rate limits, bounded metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import FakeClock
from daemon.openai.tenancy import resolve_tenant
from daemon.openai.tenant_limits import TenantLimitError, TenantRateLimiter, parse_rate_limits
from daemon.openai.tenant_metrics import TenantMetrics
from scheduling import DEFAULT_TENANT
from scheduling.policies.fair import parse_tenant_weights


def test_tenant_comes_from_user_then_header_then_key_name() -> None:
    assert resolve_tenant("alice", "team-b", "key-c") == "alice"
    assert resolve_tenant(None, "team-b", "key-c") == "team-b"
    assert resolve_tenant("  ", None, "key-c") == "key-c"
    assert resolve_tenant(None, None, None) == DEFAULT_TENANT
    with pytest.raises(ValueError, match="user: a tenant name has at most 128"):
        resolve_tenant("x" * 129, None, None)


def test_tenant_weights_parse() -> None:
    assert parse_tenant_weights("a=2, b=1") == {"a": 2.0, "b": 1.0}
    assert parse_tenant_weights("") == {}
    for bad in ("a", "a=0", "=2", "a=x", "a=inf"):
        with pytest.raises(ValueError, match="tenant_weights"):
            parse_tenant_weights(bad)


def test_rate_limit_refuses_with_the_wait_and_refills() -> None:
    clock = FakeClock()
    limiter = TenantRateLimiter(parse_rate_limits("a=100,*=10"), burst_s=2.0, clock=clock)
    limiter.take("a", 150)
    over = r"tenant 'a' is over its limit of 100 tokens/s"
    with pytest.raises(TenantLimitError, match=over) as e:
        limiter.take("a", 100)
    # 50 left of the 200-token burst; 50 more come in 0.5 s: Retry-After rounds up to 1 s.
    assert e.value.retry_after_s == 1
    clock.now = 0.5
    limiter.take("a", 100)
    # Unused output tokens come back.
    limiter.give_back("a", 60)
    limiter.take("a", 60)
    # Tenants not named share the `*` limit, each with its own bucket.
    limiter.take("b", 20)
    limiter.take("c", 20)
    with pytest.raises(TenantLimitError, match=r"'b'.* 10 tokens/s"):
        limiter.take("b", 1)
    with pytest.raises(ValueError, match="exceed tenant 'c'"):
        limiter.take("c", 21)
    assert not TenantRateLimiter({})
    unlimited = TenantRateLimiter(parse_rate_limits("a=5"))
    unlimited.take("b", 10**9)  # no `*`: other tenants are not limited
    for bad in ("a", "a=0", "a=-1", "a=x"):
        with pytest.raises(ValueError, match="tenant_rate_limits"):
            parse_rate_limits(bad)


def test_metrics_keep_a_bounded_label_set() -> None:
    clock = FakeClock()
    registry = CollectorRegistry()
    m = TenantMetrics(registry, top_k=2, half_life_s=10.0, clock=clock)
    m.served("big", 1000, 100)
    m.served("mid", 500, 50)
    m.served("tiny", 5, 1)
    m.queued("big", 0.2)
    m.rejected("tiny", "rate_limit")
    text = generate_latest(registry).decode()
    assert 'headrace_tenant_tokens_total{kind="prompt",tenant="big"} 1000.0' in text
    assert 'headrace_tenant_tokens_total{kind="prompt",tenant="other"} 5.0' in text
    assert 'headrace_tenant_rejections_total{reason="rate_limit",tenant="other"} 1.0' in text
    assert 'headrace_tenant_queue_time_seconds_count{tenant="big"} 1.0' in text
    # Later, "new" becomes busier than "mid" (whose traffic has decayed): mid's series go.
    clock.now = 60.0
    for _ in range(3):
        m.served("new", 300, 30)
    text = generate_latest(registry).decode()
    assert 'tenant="new"' in text and 'tenant="mid"' not in text
    tenants = {
        line.split('tenant="')[1].split('"')[0] for line in text.splitlines() if 'tenant="' in line
    }
    assert len(tenants) <= m.top_k + 1
