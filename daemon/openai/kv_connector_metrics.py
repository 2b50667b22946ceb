"""KV connector figures for /metrics (--kv-connector only): what was loaded and saved, how
long loads took, what failed, and how big the store is. Absent without a connector."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from daemon.engine.client import KVConnectorStats
from daemon.openai.metric_totals import advance

# A load is a few blocks from a local disk (ms) up to a long prompt from a peer (seconds).
_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Kinds shown from the start (at 0), so a rate() over them needs no first failure.
FAILURE_KINDS = ("corrupt", "missing", "peer_down", "shm")


class KVConnectorMetrics:
    """Counters advanced to the connector's running totals at scrape time."""

    def __init__(self, r: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"headrace_kv_connector_{name}", doc, registry=r)

        self.loaded_tokens = counter("loaded_tokens", "Prompt tokens whose KV a connector supplied")
        self.saved_tokens = counter("saved_tokens", "Prompt tokens whose KV went to the connector")
        self.loaded_blocks = counter("loaded_blocks", "KV blocks loaded into the paged cache")
        self.saved_blocks = counter("saved_blocks", "KV blocks saved to the connector's store")
        self.loaded_bytes = counter("loaded_bytes", "Bytes of KV loaded (payload)")
        self.saved_bytes = counter("saved_bytes", "Bytes of KV saved (payload)")
        self.failures = Counter(
            "headrace_kv_connector_load_failures",
            "Loads that got fewer blocks than asked (the rest is recomputed), by kind",
            ["kind"],
            registry=r,
        )
        for kind in FAILURE_KINDS:
            self.failures.labels(kind)
        self.transfers = Counter(
            "headrace_kv_connector_transfers",
            "Peer replies that brought blocks, by path (shm: shared memory on one host)",
            ["path"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "headrace_kv_connector_load_seconds",
            "Time from a load's start to its blocks in the paged cache",
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.store_bytes = Gauge(
            "headrace_kv_connector_store_bytes",
            "Bytes the connector's store holds (the disk tier's files, a producer's RAM)",
            registry=r,
        )

    def update(self, stats: KVConnectorStats) -> None:
        advance(self.loaded_tokens, stats.loaded_tokens)
        advance(self.saved_tokens, stats.saved_tokens)
        advance(self.loaded_blocks, stats.loaded_blocks)
        advance(self.saved_blocks, stats.saved_blocks)
        advance(self.loaded_bytes, stats.loaded_bytes)
        advance(self.saved_bytes, stats.saved_bytes)
        for kind, n in stats.failures.items():
            advance(self.failures.labels(kind), n)
        for path, n in stats.transfers.items():
            advance(self.transfers.labels(path), n)
        self.store_bytes.set(stats.store_bytes)

    def absorb(self, stats: KVConnectorStats) -> None:
        """Observe the load latencies `stats` hands out once."""
        for seconds in stats.load_seconds:
            self.load_seconds.observe(seconds)
