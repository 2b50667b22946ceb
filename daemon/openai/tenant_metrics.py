"""Per-tenant Prometheus series with a bounded label set.

Tenant names come from clients (`user`), so one series per name would grow without end.
The `top_k` tenants by recent traffic (tokens, exponentially decayed with `half_life_s`)
get their own `tenant` label; everyone else counts as "other". A tenant that drops out of
the top has its series removed, so at most top_k + 1 tenant values exist at any time.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

OTHER = "other"
REASONS = ("rate_limit", "queue_full", "policy")
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Traffic scores kept; past this the least active half is forgotten.
_MAX_SCORES = 512


class TenantMetrics:
    """Tokens served, queue time and rejections per tenant (top_k by name, then "other")."""

    def __init__(
        self,
        registry: CollectorRegistry,
        top_k: int = 8,
        half_life_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.top_k = top_k
        self.half_life_s = half_life_s
        self.clock = clock
        self.tokens = Counter(
            "headrace_tenant_tokens",
            "Tokens served per tenant (kind: prompt or output)",
            ["tenant", "kind"],
            registry=registry,
        )
        self.queue_time = Histogram(
            "headrace_tenant_queue_time_seconds",
            "Time from arrival to first being scheduled, per tenant",
            ["tenant"],
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.rejections = Counter(
            "headrace_tenant_rejections",
            "Requests refused per tenant (reason: rate_limit, queue_full, policy)",
            ["tenant", "reason"],
            registry=registry,
        )
        # Decayed traffic, stored scaled by 2^((t - t0) / half_life) so that adding needs no
        # pass over every tenant; only ratios between scores matter.
        self._scores: dict[str, float] = {}
        self._t0 = clock()
        self._top: set[str] = set()
        # The series made per tenant value, to remove when it leaves the top.
        self._made: dict[str, set[tuple[Counter | Histogram, tuple[str, ...]]]] = {}
        # "other" exists from the start, at zero, so every series is there to be scraped.
        for kind in ("prompt", "output"):
            self.tokens.labels(OTHER, kind)
        for reason in REASONS:
            self.rejections.labels(OTHER, reason)
        self.queue_time.labels(OTHER)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self._top else OTHER

    def served(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        self._count_traffic(tenant, prompt_tokens + output_tokens)
        name = self.label(tenant)
        if prompt_tokens:
            self._series(self.tokens, name, "prompt").inc(prompt_tokens)
        if output_tokens:
            self._series(self.tokens, name, "output").inc(output_tokens)

    def queued(self, tenant: str, seconds: float) -> None:
        self._series(self.queue_time, self.label(tenant)).observe(max(0.0, seconds))

    def rejected(self, tenant: str, reason: str) -> None:
        self._count_traffic(tenant, 1)
        self._series(self.rejections, self.label(tenant), reason).inc()

    def _series(self, metric: Counter | Histogram, tenant: str, *rest: str):
        self._made.setdefault(tenant, set()).add((metric, (tenant, *rest)))
        return metric.labels(tenant, *rest)

    def _count_traffic(self, tenant: str, amount: float) -> None:
        scale = 2.0 ** ((self.clock() - self._t0) / self.half_life_s)
        if scale > 1e100:  # renormalise (after ~5.5 hours at the default half-life)
            self._scores = {t: s / scale for t, s in self._scores.items()}
            self._t0, scale = self.clock(), 1.0
        self._scores[tenant] = self._scores.get(tenant, 0.0) + max(amount, 1) * scale
        if len(self._scores) > _MAX_SCORES:
            keep = heapq.nlargest(_MAX_SCORES // 2, self._scores.items(), key=lambda kv: kv[1])
            self._scores = dict(keep)
        top = {t for t, _ in heapq.nlargest(self.top_k, self._scores.items(), key=lambda kv: kv[1])}
        # (A tenant named "other" shares the aggregate's series, which always stay.)
        for gone in self._top - top - {OTHER}:
            # Its series go; it counts as "other" from now on.
            for metric, values in self._made.pop(gone, set()):
                metric.remove(*values)
        self._top = top
