"""Speculative-decoding figures for /metrics and the per-request log line."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from daemon.openai.metric_totals import advance
from scheduling import SpecDecodeStats


class SpecDecodeMetrics:
    """Engine-wide draft counters, read from the scheduler at scrape time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.proposed = Counter(
            "headrace_spec_decode_draft_tokens_proposed",
            "Draft tokens the proposer offered since start",
            registry=r,
        )
        self.verified = Counter(
            "headrace_spec_decode_draft_tokens_verified",
            "Draft tokens scheduled for verification since start",
            registry=r,
        )
        self.accepted = Counter(
            "headrace_spec_decode_draft_tokens_accepted",
            "Draft tokens the target model accepted since start",
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "headrace_spec_decode_acceptance_rate",
            "Accepted / verified draft tokens since start (0-1)",
            registry=r,
        )
        self.mean_accepted_length = Gauge(
            "headrace_spec_decode_mean_accepted_length",
            "Tokens a verifying request-step emits on average: 1 + accepted drafts",
            registry=r,
        )

    def update(self, stats: SpecDecodeStats) -> None:
        advance(self.proposed, stats.num_proposed)
        advance(self.verified, stats.num_verified)
        advance(self.accepted, stats.num_accepted)
        self.acceptance_rate.set(stats.acceptance_rate)
        self.mean_accepted_length.set(stats.mean_accepted_length)


def spec_log_fields(stats: SpecDecodeStats | None) -> str:
    """` drafts=accepted/verified accept_len=x` for a request that verified drafts."""
    if stats is None or not stats.num_verify_steps:
        return ""
    return (
        f" drafts={stats.num_accepted}/{stats.num_verified}"
        f" accept_len={stats.mean_accepted_length:.2f}"
    )
