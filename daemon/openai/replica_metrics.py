"""Data-parallel figures: per-replica gauges (label: replica index, so a bounded set) and
the router's decisions and cached-token predictions. Absent with one in-process engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from daemon.engine.client import EngineStats
from daemon.openai.metric_totals import advance


class ReplicaMetrics:
    """Filled from EngineStats.replicas and EngineStats.router at scrape time."""

    def __init__(self, r: CollectorRegistry) -> None:
        label = ["replica"]
        self.up = Gauge("headrace_replica_up", "1 while the replica serves", label, registry=r)
        self.running = Gauge(
            "headrace_replica_requests_running",
            "Requests running on the replica",
            label,
            registry=r,
        )
        self.waiting = Gauge(
            "headrace_replica_requests_waiting",
            "Requests waiting on the replica",
            label,
            registry=r,
        )
        self.kv_usage = Gauge(
            "headrace_replica_kv_cache_usage", "Replica's KV blocks in use (0-1)", label, registry=r
        )
        self.restarts = Counter(
            "headrace_replica_restarts", "Times the replica was restarted", label, registry=r
        )
        self.prefix_queries = Counter(
            "headrace_replica_prefix_cache_queries_tokens",
            "Prompt tokens the replica looked up in its prefix cache",
            label,
            registry=r,
        )
        self.prefix_hits = Counter(
            "headrace_replica_prefix_cache_hits_tokens",
            "Prompt tokens the replica served from its prefix cache",
            label,
            registry=r,
        )
        self.routed = Counter(
            "headrace_router_requests",
            "Requests routed, by router policy and the reason for the pick",
            ["policy", "reason"],
            registry=r,
        )
        self.predicted = Counter(
            "headrace_router_predicted_cached_tokens",
            "Prompt tokens the router expected the picked replica to have cached",
            registry=r,
        )
        self.reported = Counter(
            "headrace_router_reported_cached_tokens",
            "Prompt tokens the picked replicas reported served from their cache",
            registry=r,
        )
        self.pd_prefills = Counter(
            "headrace_router_pd_prefills",
            "P/D: prompts by their producer pass (ok; failed or none: the consumer computed it)",
            ["outcome"],
            registry=r,
        )

    def update(self, stats: EngineStats) -> None:
        for rep in stats.replicas:
            i = str(rep.index)
            self.up.labels(i).set(1 if rep.healthy else 0)
            self.running.labels(i).set(rep.running)
            self.waiting.labels(i).set(rep.waiting)
            self.kv_usage.labels(i).set(rep.kv_usage)
            advance(self.restarts.labels(i), rep.restarts)
            advance(self.prefix_queries.labels(i), rep.prefix_query_tokens)
            advance(self.prefix_hits.labels(i), rep.prefix_hit_tokens)
        if stats.router is not None:
            for (policy, reason), n in stats.router.decisions.items():
                advance(self.routed.labels(policy, reason), n)
            advance(self.predicted, stats.router.predicted_cached_tokens)
            advance(self.reported, stats.router.reported_cached_tokens)
            for outcome, n in stats.router.pd_prefills.items():
                advance(self.pd_prefills.labels(outcome), n)
