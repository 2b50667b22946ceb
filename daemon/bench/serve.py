"""`headrace bench serve`: send a bounded workload to one endpoint and report what it did."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from daemon.bench.arrivals import arrival_offsets
from daemon.bench.client import Endpoint, scrape, send, server_deltas
from daemon.bench.results import RequestRecord, SLOSpec, summarize
from daemon.bench.tenants import TenantSpec, format_tenants, summarize_tenants
from daemon.bench.workloads import BenchRequest, RequestClass


@dataclass(slots=True)
class RunSpec:
    """How to send: arrival rate and shape, concurrency cap, and the bounds of the run."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_duration_s: float | None = None
    seed: int = 0
    warmup: int = 1
    progress: bool = False
    poll_metrics_s: float = 0.5
    # Send times in seconds from the start, one per request, instead of drawing them from
    # the rate: replays part of another run's schedule (a class alone, at its own times).
    offsets: tuple[float, ...] | None = None


@dataclass(slots=True)
class RunOutcome:
    """Everything one run measured: records, times, and the server's counters."""

    records: list[RequestRecord]
    t0: float
    duration_s: float
    server_before: dict[str, float] | None
    server_after: dict[str, float] | None
    kv_peak: float | None
    cancelled: int = 0
    in_flight: list[tuple[float, int]] = field(default_factory=list)


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.ok
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f" failed {self.failed}  {elapsed:6.1f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def discover_model(session: aiohttp.ClientSession) -> str | None:
    """The first model the server lists, for servers that require a `model` field."""
    try:
        async with session.get("v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                return data[0]["id"] if data else None
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        return None
    return None


def spec_offsets(spec: RunSpec, n: int) -> list[float]:
    """The send times of `n` requests: the spec's own, or drawn from its rate."""
    if spec.offsets is None:
        return arrival_offsets(n, spec.request_rate, spec.burstiness, spec.seed)
    if len(spec.offsets) != n:
        raise ValueError(f"offsets: {len(spec.offsets)} send times for {n} requests")
    return list(spec.offsets)


async def run_workload(
    ep: Endpoint, requests: list[BenchRequest], spec: RunSpec, count_tokens: Any
) -> RunOutcome:
    """Send `requests` on the arrival schedule, at most `max_concurrency` at a time, until all
    have finished or `max_duration_s` has passed (then the rest are cancelled and reported)."""
    limit = (spec.max_concurrency or len(requests) or 1) + 4
    async with ep.session(limit) as session:
        if ep.model is None:
            ep.model = await discover_model(session)
        for _ in range(spec.warmup):
            warm = BenchRequest("Hello", [{"role": "user", "content": "Hello"}], 1, 4)
            rec = await send(session, ep, warm, count_tokens)
            if rec.error and rec.error.startswith(("ClientConnectorError", "HTTP 404")):
                raise ConnectionError(f"{ep.base_url}: warm-up request failed: {rec.error}")
        before = await scrape(session)
        offsets = spec_offsets(spec, len(requests))
        sem = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
        progress = _Progress(len(requests), spec.progress)
        records: list[RequestRecord | None] = [None] * len(requests)
        in_flight: list[tuple[float, int]] = []
        active = 0
        kv_peak: float | None = None
        t0 = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> None:
            nonlocal active
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with sem or contextlib.nullcontext():
                active += 1
                in_flight.append((time.perf_counter() - t0, active))
                try:
                    rec = await send(session, ep, req, count_tokens)
                finally:
                    active -= 1
                    in_flight.append((time.perf_counter() - t0, active))
            records[i] = rec
            progress.update(rec)

        async def poll() -> None:
            nonlocal kv_peak
            while True:
                await asyncio.sleep(spec.poll_metrics_s)
                m = await scrape(session)
                if m and "kv_usage" in m:
                    kv_peak = max(kv_peak or 0.0, m["kv_usage"])

        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
        poller = asyncio.create_task(poll()) if before else None
        _, pending = await asyncio.wait(tasks, timeout=spec.max_duration_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
        if poller:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        progress.close()
        after = await scrape(session)
        if after and "kv_usage" in after:
            kv_peak = max(kv_peak or 0.0, after["kv_usage"])
        cancelled = 0
        final: list[RequestRecord] = []
        for i, rec in enumerate(records):
            if rec is None:
                cancelled += 1
                rec = RequestRecord(t0 + offsets[i], requests[i].prompt_tokens)
                rec.request_class = requests[i].request_class
                rec.error = f"cancelled at the {spec.max_duration_s:g}s time bound"
            final.append(rec)
        return RunOutcome(final, t0, duration, before, after, kv_peak, cancelled, in_flight)


def build_result(
    outcome: RunOutcome,
    spec: RunSpec,
    ep: Endpoint,
    slo: SLOSpec | None,
    classes: list[RequestClass],
    meta: dict[str, Any],
    tenants: list[TenantSpec] | None = None,
) -> dict[str, Any]:
    """The result-file object: vLLM's key names where they mean the same thing."""
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if ep.api == "chat" else "openai",
        "base_url": ep.base_url,
        "model_id": ep.model,
        "num_prompts": len(outcome.records),
        "request_rate": "inf" if math.isinf(spec.request_rate) else spec.request_rate,
        "burstiness": spec.burstiness,
        "max_concurrency": spec.max_concurrency,
        "ignore_eos": ep.ignore_eos,
        **meta,
    }
    result |= summarize(outcome.records, outcome.duration_s, slo)
    result["max_concurrent_requests"] = max((n for _, n in outcome.in_flight), default=0)
    result["server"] = server_deltas(outcome.server_before, outcome.server_after, outcome.kv_peak)
    if classes:
        result["classes"] = {
            c.name: {
                "share": c.share,
                "priority": c.priority,
                **summarize(
                    [r for r in outcome.records if r.request_class == c.name],
                    outcome.duration_s,
                    c.slo if (c.slo.ttft_ms or c.slo.tpot_ms) else slo,
                ),
            }
            for c in classes
        }
    if tenants:
        result["tenants"] = summarize_tenants(outcome.records, tenants, outcome.duration_s)
    result["input_lens"] = [r.prompt_tokens for r in outcome.records]
    result["output_lens"] = [r.output_tokens for r in outcome.records]
    result["ttfts"] = [r.ttft_s if r.ok else None for r in outcome.records]
    result["itls"] = [r.itls_s if r.ok else [] for r in outcome.records]
    result["e2els"] = [r.e2el_s if r.ok else None for r in outcome.records]
    result["errors_per_request"] = [r.error for r in outcome.records]
    result["classes_per_request"] = [r.request_class for r in outcome.records]
    result["in_flight"] = outcome.in_flight
    return result


def format_report(result: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The human table, in the layout vLLM users know."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        text = "n/a" if value is None else format(value, fmt)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    for cause, n in sorted(result["errors"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:>4} x {cause[:52]}")
    row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
        row("Output goodput (tok/s):", result["output_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for key, name in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"{name:-^60}")
        row(f"Mean {key.upper()} (ms):", result[f"mean_{key}_ms"], ".2f")
        row(f"Median {key.upper()} (ms):", result[f"median_{key}_ms"], ".2f")
        for p in (90, 99):
            row(f"P{p} {key.upper()} (ms):", result[f"p{p}_{key}_ms"], ".2f")
    server = result.get("server") or {}
    lines.append(f"{'Server counters (/metrics)':-^60}")
    row("Preemptions during the run:", server.get("preemptions"), ".0f")
    row("Prefix-cache hit rate:", server.get("prefix_cache_hit_rate"), ".3f")
    row("KV cache usage peak:", server.get("kv_cache_usage_peak"), ".3f")
    for name, c in (result.get("classes") or {}).items():
        lines.append(f"{' class ' + name + ' ':-^60}")
        row("Completed / failed:", f"{c['completed']} / {c['failed']}")
        if "request_goodput" in c:
            row("Goodput (req/s):", c["request_goodput"], ".2f")
            row("Share meeting its SLO:", c["goodput_fraction"], ".3f")
        row("P99 TTFT (ms):", c["p99_ttft_ms"], ".1f")
        row("P99 TPOT (ms):", c["p99_tpot_ms"], ".1f")
    if "tenants" in result:
        lines += format_tenants(result["tenants"])
    lines.append("=" * 60)
    return "\n".join(lines)


def write_result(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_bytes(
        orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
