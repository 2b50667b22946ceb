"""Prometheus metrics (prometheus-client), one registry per server."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from daemon.engine.client import EngineStats
from daemon.openai.kv_connector_metrics import KVConnectorMetrics
from daemon.openai.metric_totals import advance
from daemon.openai.replica_metrics import ReplicaMetrics
from daemon.openai.spec_metrics import SpecDecodeMetrics
from daemon.openai.tenant_metrics import TenantMetrics

_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Request-level histograms and counters, plus engine gauges read at scrape time."""

    # The text exposition format 0.0.4: what every Prometheus version scrapes.
    content_type = CONTENT_TYPE_PLAIN_0_0_4

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("headrace_requests_running", "Requests in the running set", registry=r)
        self.waiting = Gauge(
            "headrace_requests_waiting", "Requests waiting to be scheduled", registry=r
        )
        self.kv_usage = Gauge(
            "headrace_kv_cache_usage", "Fraction of KV blocks in use (0-1)", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "headrace_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        # Counters (exposed with the _total suffix), advanced at scrape time to the engine's
        # own running totals.
        self.prefix_queries = Counter(
            "headrace_prefix_cache_queries_tokens", "Prompt tokens looked up", registry=r
        )
        self.preemptions = Counter("headrace_preemptions", "Preemptions since start", registry=r)
        self.interrupted_steps = Counter(
            "headrace_interrupted_steps",
            "Steps stopped between layers for an urgent arrival and taken back, since start",
            registry=r,
        )
        self.ttft = Histogram(
            "headrace_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "headrace_inter_token_latency_seconds",
            "Time between tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "headrace_e2e_request_latency_seconds",
            "Request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "headrace_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "headrace_generation_tokens", "Tokens generated", registry=r
        )
        self.finished = Counter(
            "headrace_requests_finished", "Finished requests", ["finish_reason"], registry=r
        )
        self.spec_decode = SpecDecodeMetrics(r)
        self.tenants = TenantMetrics(r)
        # Registered on the first scrape that has replicas: one in-process engine shows none.
        self.replicas: ReplicaMetrics | None = None
        # Registered on the first read of an engine with a KV connector.
        self.kv_connector: KVConnectorMetrics | None = None

        self.grammar_compile = Histogram(
            "headrace_grammar_compile_seconds",
            "Time to compile one grammar (cache misses only)",
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        self.grammar_hits = Counter(
            "headrace_grammar_cache_hits", "Grammar compile cache hits since start", registry=r
        )
        self.grammar_misses = Counter(
            "headrace_grammar_cache_misses", "Grammar compile cache misses since start", registry=r
        )
        # Advanced by the API: strict outputs failing jsonschema (daemon/openai/output_check.py).
        self.grammar_validation_failures = Counter(
            "headrace_grammar_validation_failures",
            "Strict structured outputs that ended with stop but failed schema validation",
            registry=r,
        )
        self.constrained = Counter(
            "headrace_constrained_requests",
            "Requests with structured output or a forced tool call, since start",
            registry=r,
        )

    def render(self, stats: EngineStats) -> bytes:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        advance(self.prefix_queries, stats.prefix_query_tokens)
        advance(self.preemptions, stats.preemptions)
        advance(self.interrupted_steps, stats.interrupted_steps)
        advance(self.constrained, stats.constrained_requests)
        advance(self.grammar_hits, stats.grammar_cache_hits)
        advance(self.grammar_misses, stats.grammar_cache_misses)
        self.spec_decode.update(stats.spec)
        self.absorb(stats)
        if self.kv_connector is not None and stats.kv_connector is not None:
            self.kv_connector.update(stats.kv_connector)
        if stats.replicas:
            if self.replicas is None:
                self.replicas = ReplicaMetrics(self.registry)
            self.replicas.update(stats)
        return generate_latest(self.registry)

    def absorb(self, stats: EngineStats) -> None:
        """Observe what `stats` hands out once (whoever read it: a scrape, or the API)."""
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile.observe(seconds)
        for tenant, seconds in stats.tenant_queue_seconds:
            self.tenants.queued(tenant, seconds)
        if stats.kv_connector is not None:
            if self.kv_connector is None:
                self.kv_connector = KVConnectorMetrics(self.registry)
            self.kv_connector.absorb(stats.kv_connector)
