"""Prometheus counters that follow an engine's own running totals."""

from __future__ import annotations

from prometheus_client import Counter


def advance(counter: Counter, total: float) -> None:
    """Move a counter up to an engine total, read at scrape time (counters never go down)."""
    delta = total - counter._value.get()
    if delta > 0:
        counter.inc(delta)
