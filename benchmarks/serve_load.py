"""Bounded streaming load against the daemon: output tok/s and TTFT/ITL/E2E percentiles.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 1 8 32
    python benchmarks/serve_load.py --spawn            # start daemons itself, compare variants

With --spawn it starts `headrace serve` on the embedded model once per variant, side by side
in this run: the default (threads = cores - 1; batch-queue overlap off on CPU), all cores
as torch threads, and overlap on. The RESULT line gives the ratios of the variants to the default
at the highest concurrency. Every loop is bounded: a fixed number of requests per level.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from stream_timer import timed_stream

from scheduling.simulator import percentile

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sample:
    ttft: float
    e2e: float
    tokens: int
    gaps: list[float] = field(default_factory=list)


async def one(client: httpx.AsyncClient, i: int, max_tokens: int) -> Sample:
    body = {
        "prompt": f"Request {i}: write about the history of the number {i}.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t = await timed_stream(client, body)
    return Sample(t.ttft, t.e2e, t.completion_tokens, t.gaps)


async def level(base: str, uds: str | None, concurrency: int, requests: int, max_tokens: int):
    transport = httpx.AsyncHTTPTransport(uds=uds) if uds else None
    async with httpx.AsyncClient(
        base_url=base,
        timeout=600,
        transport=transport,
        limits=httpx.Limits(max_connections=concurrency + 4),
    ) as c:
        await one(c, -1, 4)  # warm-up
        queue = list(range(requests))
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                samples.append(await one(c, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    gaps = [g for s in samples for g in s.gaps]
    return {
        "concurrency": concurrency,
        "tok_s": sum(s.tokens for s in samples) / wall,
        "ttft_p50": percentile([s.ttft for s in samples], 50) * 1000,
        "ttft_p99": percentile([s.ttft for s in samples], 99) * 1000,
        "itl_p50": percentile(gaps, 50) * 1000,
        "itl_p99": percentile(gaps, 99) * 1000,
        "e2e_p50": percentile([s.e2e for s in samples], 50) * 1000,
        "e2e_p99": percentile([s.e2e for s in samples], 99) * 1000,
    }


def print_table(label: str, rows: list[dict]) -> None:
    print(f"== {label}")
    print(" conc   tok/s  TTFT p50  TTFT p99  ITL p50  ITL p99  E2E p50  E2E p99  (ms)")
    for r in rows:
        print(
            f" {r['concurrency']:4d} {r['tok_s']:7.1f} {r['ttft_p50']:9.0f} {r['ttft_p99']:9.0f}"
            f" {r['itl_p50']:8.0f} {r['itl_p99']:8.0f} {r['e2e_p50']:8.0f} {r['e2e_p99']:8.0f}"
        )


def run_levels(base: str, uds: str | None, args: argparse.Namespace) -> list[dict]:
    return [
        asyncio.run(level(base, uds, c, max(args.min_requests, 2 * c), args.max_tokens))
        for c in args.concurrency
    ]


def spawn(extra: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "daemon.service.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("daemon did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--uds", help="talk over this Unix socket instead of TCP")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spawn", action="store_true", help="start and compare daemon variants")
    args = ap.parse_args()
    if not args.spawn:
        rows = run_levels(args.url, args.uds, args)
        print_table(args.url, rows)
        top = rows[-1]
        print(
            f"RESULT tok_s={top['tok_s']:.1f} ttft_p99_ms={top['ttft_p99']:.0f} "
            f"itl_p99_ms={top['itl_p99']:.0f} concurrency={top['concurrency']}"
        )
        return
    cores = os.cpu_count() or 1
    variants = {
        "default": [],
        f"threads={cores}": ["--threads", str(cores)],
        "overlap": ["--overlap"],
    }
    results = {}
    for i, (name, extra) in enumerate(variants.items()):
        port = 8700 + i
        proc = spawn(extra, port)
        try:
            results[name] = run_levels(f"http://127.0.0.1:{port}", None, args)
        finally:
            proc.terminate()
            proc.wait(60)
        print_table(f"{name} {' '.join(extra)}", results[name])
    base = results["default"][-1]
    ratios = " ".join(
        f"{name.replace('=', '')}_vs_default={rows[-1]['tok_s'] / base['tok_s']:.3f}"
        for name, rows in results.items()
        if name != "default"
    )
    print(
        f"RESULT {ratios} default_tok_s={base['tok_s']:.1f} "
        f"default_ttft_p99_ms={base['ttft_p99']:.0f} default_itl_p99_ms={base['itl_p99']:.0f} "
        f"concurrency={base['concurrency']}"
    )


if __name__ == "__main__":
    main()
