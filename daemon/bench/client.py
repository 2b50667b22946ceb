"""The HTTP side: stream one request over SSE, and read a server's Prometheus counters."""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from daemon.bench.results import RequestRecord
from daemon.bench.workloads import BenchRequest


def check_loopback(url: str, allow_remote: bool) -> None:
    """Refuse a non-loopback host unless --allow-remote: a load test is not for strangers."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"--base-url: {url!r} has no host")
    if allow_remote:
        return
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise ValueError(f"--base-url: cannot resolve {host}: {e}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(
            f"--base-url: {host} is not a loopback address; pass --allow-remote to load it"
        )


@dataclass(slots=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str
    api: str = "completions"  # or "chat"
    model: str | None = None
    uds: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def session(self, limit: int) -> aiohttp.ClientSession:
        # One connection a request, as vLLM's benchmark_serving opens a session a request: a
        # pooled keep-alive connection the server has just closed fails the next request
        # with "Server disconnected" before the server sees it (llama-server: about one in
        # eight at c=1), which a client's retry would hide and a load test counted against
        # the server.
        connector = (
            aiohttp.UnixConnector(path=self.uds, limit=limit, force_close=True)
            if self.uds
            else aiohttp.TCPConnector(limit=limit, force_close=True)
        )
        return aiohttp.ClientSession(
            base_url=self.base_url.rstrip("/") + "/",
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        if self.api == "chat":
            body["messages"] = req.messages or [{"role": "user", "content": req.prompt or ""}]
        else:
            body["prompt"] = req.prompt if req.prompt is not None else req.messages[-1]["content"]  # type: ignore[index]
        if self.ignore_eos:
            body["ignore_eos"] = True
        if req.priority is not None:
            body["priority"] = req.priority
        if req.slo:
            body["slo"] = req.slo
        if req.tenant is not None:
            body["user"] = req.tenant
        return body | (self.extra_body or {})


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send(
    session: aiohttp.ClientSession, ep: Endpoint, req: BenchRequest, count_tokens: Any
) -> RequestRecord:
    """Stream one request; every failure becomes the record's error, never an exception."""
    rec = RequestRecord(
        time.perf_counter(),
        req.prompt_tokens,
        request_class=req.request_class,
        tenant=req.tenant,
    )
    usage_tokens = None
    parts: list[str] = []
    try:
        async with session.post(ep.path.lstrip("/"), json=ep.body(req)) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:120].replace("\n", " ")
                rec.error = f"HTTP {resp.status}: {detail}"
                rec.end = time.perf_counter()
                return rec
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    chunk = orjson.loads(payload)
                    if chunk.get("error"):
                        rec.error = f"stream error: {str(chunk['error'])[:100]}"
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    text = _chunk_text(chunk)
                    if text:
                        rec.chunk_times.append(time.perf_counter())
                        parts.append(text)
        rec.end = time.perf_counter()
    except TimeoutError:
        rec.error = f"timeout after {ep.timeout_s:g}s"
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {str(e)[:100]}"
    except orjson.JSONDecodeError:
        rec.error = "malformed SSE chunk"
    rec.generated_text = "".join(parts)
    if usage_tokens:
        rec.output_tokens = int(usage_tokens)
    elif parts:
        rec.output_tokens = count_tokens(rec.generated_text)
    if rec.error is None and rec.end is not None and not rec.chunk_times:
        rec.error = "no output tokens"
    return rec


# Server counters: the names each engine exports for the same thing. headrace's come from
# daemon/openai/metrics.py; vLLM V1 and llama.cpp names are the ones their /metrics pages use.
SERVER_METRICS: dict[str, tuple[str, ...]] = {
    "preemptions": (
        "headrace_preemptions_total",
        "headrace_preemptions",
        "vllm:num_preemptions_total",
    ),
    "kv_usage": (
        "headrace_kv_cache_usage",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "llamacpp:kv_cache_usage_ratio",
    ),
    "prefix_hit_rate": ("headrace_prefix_cache_hit_rate",),
    "prefix_queries": (
        "headrace_prefix_cache_queries_tokens_total",
        "headrace_prefix_cache_queries_tokens",
        "vllm:prefix_cache_queries_total",
    ),
    "prefix_hits": ("vllm:prefix_cache_hits_total",),
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Our counters out of a Prometheus text page (labels summed)."""
    raw: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            raw[name] = raw.get(name, 0.0) + float(value)
        except ValueError:
            continue
    out: dict[str, float] = {}
    for key, names in SERVER_METRICS.items():
        for n in names:
            if n in raw:
                out[key] = raw[n]
                break
    if "prefix_hits" not in out and "prefix_hit_rate" in out and "prefix_queries" in out:
        out["prefix_hits"] = out["prefix_hit_rate"] * out["prefix_queries"]
    return out


async def scrape(session: aiohttp.ClientSession) -> dict[str, float] | None:
    """The server's counters, or None when it has no /metrics page."""
    try:
        async with session.get("metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            return parse_prometheus(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return None


def server_deltas(
    before: dict[str, float] | None, after: dict[str, float] | None, kv_peak: float | None
) -> dict[str, float | None]:
    """Preemptions and prefix-cache hit rate during the run, and the KV usage peak seen."""
    if not before or not after:
        return {"preemptions": None, "prefix_cache_hit_rate": None, "kv_cache_usage_peak": kv_peak}
    pre = None
    if "preemptions" in after:
        pre = after["preemptions"] - before.get("preemptions", 0.0)
    hit = None
    if "prefix_queries" in after and "prefix_hits" in after:
        q = after["prefix_queries"] - before.get("prefix_queries", 0.0)
        h = after["prefix_hits"] - before.get("prefix_hits", 0.0)
        hit = h / q if q > 0 else 0.0
    return {"preemptions": pre, "prefix_cache_hit_rate": hit, "kv_cache_usage_peak": kv_peak}
