"""Multi-tenant loads for `bench serve --tenants`: who sends what, and how fairly it was served.

Each request is drawn to a tenant by the tenants' traffic shares and carries the tenant as
the OpenAI `user` field (headrace's `fair` policy shares the engine by it). The result
breaks the run down per tenant and gives Jain's fairness index of their output rates over
the window in which every tenant still had requests outstanding (all backlogged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.bench.results import RequestRecord, summarize
from daemon.bench.workloads import BenchRequest


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant and its share of the requests sent."""

    name: str
    share: float

    @classmethod
    def parse_list(cls, text: str) -> list[TenantSpec]:
        """`NAME:SHARE,NAME:SHARE,...`, e.g. `heavy:10,a:1,b:1,c:1`."""
        out = []
        for part in text.split(","):
            name, sep, share = part.strip().partition(":")
            try:
                value = float(share) if sep else 1.0
            except ValueError:
                raise ValueError(f"--tenants: {part!r}: the share is not a number") from None
            if not name or not value > 0:
                raise ValueError(f"--tenants: {part!r} is not NAME:SHARE with SHARE > 0")
            out.append(cls(name, value))
        if len({t.name for t in out}) != len(out):
            raise ValueError("--tenants: tenant names must be unique")
        return out


def assign_tenants(
    requests: list[BenchRequest], tenants: list[TenantSpec], seed: int
) -> list[BenchRequest]:
    """Give each request a tenant drawn by the tenants' shares (deterministic in `seed`)."""
    if not tenants:
        return requests
    shares = np.array([t.share for t in tenants], dtype=float)
    picks = np.random.default_rng(seed + 2).choice(
        len(tenants), size=len(requests), p=shares / shares.sum()
    )
    for req, k in zip(requests, picks):
        req.tenant = tenants[k].name
    return requests


def backlogged_window(records: list[RequestRecord], names: list[str]) -> tuple[float, float]:
    """From the first send to the moment the first tenant had nothing left outstanding."""
    start = min(r.start for r in records)
    ends = []
    for name in names:
        mine = [r.end or r.start for r in records if r.tenant == name]
        ends.append(max(mine) if mine else start)
    return start, min(ends)


def tokens_in_window(records: list[RequestRecord], t0: float, t1: float) -> float:
    """Output tokens streamed in [t0, t1], each request's spread evenly over its chunks."""
    total = 0.0
    for r in records:
        if r.ok and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            total += per_chunk * sum(t0 <= t <= t1 for t in r.chunk_times)
    return total


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one takes everything."""
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if square > 0 else math.nan


def summarize_tenants(
    records: list[RequestRecord], tenants: list[TenantSpec], duration_s: float
) -> dict[str, Any]:
    """Per tenant: the usual summary plus its output tok/s while all were backlogged."""
    names = [t.name for t in tenants]
    t0, t1 = backlogged_window(records, names) if records else (0.0, 0.0)
    span = max(t1 - t0, 1e-9)
    per: dict[str, Any] = {}
    for t in tenants:
        mine = [r for r in records if r.tenant == t.name]
        per[t.name] = {
            "share": t.share,
            "backlogged_output_throughput": tokens_in_window(mine, t0, t1) / span,
            **summarize(mine, duration_s),
        }
    rates = [per[n]["backlogged_output_throughput"] for n in names]
    return {"window_s": t1 - t0, "jain_index": jain_index(rates), "per_tenant": per}


def format_tenants(summary: dict[str, Any]) -> list[str]:
    title = f" tenants (all backlogged for {summary['window_s']:.1f} s) "
    lines = [f"{title:-^60}"]
    lines.append(f"{'tenant':<12}{'tok/s bklg':>12}{'tok/s all':>11}{'TTFT p50':>12}{'p99':>10}")
    for name, t in summary["per_tenant"].items():
        lines.append(
            f"{name[:12]:<12}{t['backlogged_output_throughput']:>12.1f}"
            f"{t['output_throughput']:>11.1f}{t['median_ttft_ms']:>12.0f}{t['p99_ttft_ms']:>10.0f}"
        )
    lines.append(f"{'Jain fairness index (backlogged):':<44}{summary['jain_index']:>16.3f}")
    return lines
