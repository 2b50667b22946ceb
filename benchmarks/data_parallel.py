"""Data-parallel serving: routers on a shared-prefix chat workload, DP=2 vs DP=1, and the
replica transport's ITL overhead.

    python benchmarks/data_parallel.py                       # the defaults below
    python benchmarks/data_parallel.py --users 8 --turns 2   # small, to see it work

Workload: `--prefixes` long system prompts (`--prefix-len` tokens each), `--users` users
spread over them, `--turns` turns each (a turn's prompt is its system prompt, the history
and a new user message), `--concurrency` users at once. `--kv-cache-memory` is sized by
default so that all prefixes exceed one replica's KV cache but fit in two.

Runs, each a fresh `headrace serve` on the embedded model:
  dp2 cache_aware | dp2 round_robin | dp2 least_load | dp1   (the workload)
  one stream at concurrency 1 on a replica process (DP=2, round robin; the other replica
  idle) vs the same engine in-process (DP=1), both with `--threads` threads per engine:
  the replica transport's ITL cost (target: ratio <= 1.05). `--itl-only` runs just these two.
Figures: cached-token share of prompt tokens, TTFT p50/p99, output tok/s, ITL p50.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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
class Figures:
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    def row(self) -> dict[str, float]:
        return {
            "cached_share": self.cached_tokens / max(1, self.prompt_tokens),
            "ttft_p50_ms": 1000 * percentile(self.ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(self.ttfts, 99),
            "tok_s": self.output_tokens / max(1e-9, self.seconds),
            "itl_p50_ms": 1000 * percentile(self.gaps, 50) if self.gaps else 0.0,
        }


async def stream(client: httpx.AsyncClient, prompt: list[int], tokens: int, f: Figures) -> None:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t = await timed_stream(client, body)
    f.ttfts.append(t.ttft)
    f.gaps += t.gaps
    f.prompt_tokens += t.prompt_tokens
    f.cached_tokens += t.cached_tokens
    f.output_tokens += t.completion_tokens


async def chat_workload(url: str, args: argparse.Namespace) -> Figures:
    """Many users over a few long system prompts, multi-turn; `concurrency` users at once."""
    rng = random.Random(0)
    vocab = 40000
    prefixes = [
        [rng.randrange(100, vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    f = Figures()
    gate = asyncio.Semaphore(args.concurrency)

    async def user(u: int, client: httpx.AsyncClient) -> None:
        history = list(prefixes[u % args.prefixes])
        async with gate:
            for _ in range(args.turns):
                history += [rng.randrange(100, vocab) for _ in range(args.turn_len)]
                await stream(client, history, args.output_len, f)
                history += [rng.randrange(100, vocab) for _ in range(args.output_len)]

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(user(u, client) for u in range(args.users)))
    f.seconds = time.perf_counter() - start
    return f


async def one_stream(url: str, tokens: int) -> Figures:
    f = Figures()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(2):  # first-call costs out of the way (on both replicas of a DP=2)
            await stream(client, [1, 2, 3, 4], 8, Figures())
        start = time.perf_counter()
        await stream(client, list(range(100, 164)), tokens, f)
        f.seconds = time.perf_counter() - start
    return f


class Server:
    """`headrace serve` on a free port with the given flags; stopped with SIGTERM."""

    def __init__(self, port: int, flags: list[str], log: Path) -> None:
        cmd = [sys.executable, "-m", "daemon.service.cli", "serve", "--port", str(port), *flags]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def run(port: int, flags: list[str], log: Path, work) -> dict[str, float]:
    server = Server(port, flags, log)
    try:
        return asyncio.run(work(server.url)).row()
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--itl-tokens", type=int, default=128)
    p.add_argument("--itl-only", action="store_true", help="only the transport's ITL runs")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes per replica")
    p.add_argument("--threads", type=int, default=None, help="per replica (default cores // 2)")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--log-dir", type=Path, default=Path("bench-results/data_parallel"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cores // 2)
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 4 bytes = 92 KB a token.
    per_token = 30 * 3 * 64 * 2 * 4
    total = args.prefixes * (args.prefix_len + args.turns * (args.turn_len + args.output_len))
    kv = args.kv_cache_memory or int(per_token * total * 0.6)  # > one replica, < two
    common = ["--dtype", "float32", "--kv-cache-memory", str(kv), "--max-model-len", "4096"]
    dp2 = ["--data-parallel-size", "2", "--threads", str(threads), *common]
    itl_local = run(
        args.port,
        ["--threads", str(threads), *common],
        args.log_dir / "itl_dp1.log",
        lambda url: one_stream(url, args.itl_tokens),
    )
    itl_replica = run(
        args.port,
        [*dp2, "--router", "round_robin"],
        args.log_dir / "itl_dp2.log",
        lambda url: one_stream(url, args.itl_tokens),
    )
    itl = {
        "itl_p50_replica_over_inprocess": itl_replica["itl_p50_ms"]
        / max(1e-9, itl_local["itl_p50_ms"]),
        "itl_p50_inprocess_ms": itl_local["itl_p50_ms"],
        "itl_p50_replica_ms": itl_replica["itl_p50_ms"],
    }
    print(
        f"ITL p50 at c=1, {threads} threads per engine: in-process "
        f"{itl_local['itl_p50_ms']:.2f} ms, replica process {itl_replica['itl_p50_ms']:.2f} ms"
    )
    if args.itl_only:
        print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in itl.items()))
        return 0
    rows: dict[str, dict[str, float]] = {}
    for router in ("cache_aware", "round_robin", "least_load"):
        rows[f"dp2_{router}"] = run(
            args.port,
            [*dp2, "--router", router],
            args.log_dir / f"dp2_{router}.log",
            lambda url: chat_workload(url, args),
        )
    rows["dp1"] = run(
        args.port,
        ["--threads", str(threads), *common],
        args.log_dir / "dp1.log",
        lambda url: chat_workload(url, args),
    )
    print(f"kv cache per replica: {kv} bytes; {threads} threads per replica, {cores} cores")
    print(f"{'run':<18} {'cached':>7} {'ttft p50':>9} {'ttft p99':>9} {'tok/s':>8}")
    for name, r in rows.items():
        print(
            f"{name:<18} {r['cached_share']:>7.1%} {r['ttft_p50_ms']:>7.0f}ms "
            f"{r['ttft_p99_ms']:>7.0f}ms {r['tok_s']:>8.1f}"
        )
    ca, rr, ll = rows["dp2_cache_aware"], rows["dp2_round_robin"], rows["dp2_least_load"]
    ratios = {
        "cached_share_ca_over_rr": ca["cached_share"] / max(1e-9, rr["cached_share"]),
        "ttft_p50_ca_over_rr": ca["ttft_p50_ms"] / max(1e-9, rr["ttft_p50_ms"]),
        "ttft_p50_ca_over_ll": ca["ttft_p50_ms"] / max(1e-9, ll["ttft_p50_ms"]),
        "tok_s_dp2_over_dp1": ca["tok_s"] / max(1e-9, rows["dp1"]["tok_s"]),
        "itl_p50_replica_over_inprocess": itl["itl_p50_replica_over_inprocess"],
        "cached_share_ca": ca["cached_share"],
        "cached_share_rr": rr["cached_share"],
        "itl_p50_inprocess_ms": itl["itl_p50_inprocess_ms"],
        "itl_p50_replica_ms": itl["itl_p50_replica_ms"],
    }
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
