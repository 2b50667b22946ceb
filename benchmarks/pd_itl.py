"""P/D disaggregation: decode ITL of running streams while long prompts arrive.

    python benchmarks/pd_itl.py [--streams 8] [--output-len 128] [--long-len 4000]
                                [--long-prompts 4] [--long-every 2.0] [--model PATH]
                                [--kv-commit-mb-per-step MB]

Two set-ups on the same machine, each measured twice (idle: only the streams; loaded: the
streams plus long prompts arriving every --long-every seconds):
  colocated  one `headrace serve --threads 2`
  P/D        a producer and a consumer (`--kv-connector peer`, --threads 1 each) behind
             `headrace pd-front` (in this process): long prompts are computed by the
             producer, and the consumer only pulls their KV and decodes
ITL = gaps between a stream's SSE chunks after its first. Target: P/D loaded ITL p99
<= 1.5x its idle p99. The decoding instance (colocated, or the consumer) writes a step
profile (--profile-steps); its steps in each phase are summarised beside the ITLs: the
longest step, and the most time one step spent copying loaded KV into the paged cache.
`--quantization none` everywhere: both P/D instances must compute the same KV layout
(the auto choice is a start-up micro-benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from machine import cpu_description

from daemon.service.pd_front import PDFrontDoor

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def instance(tmp: Path, name: str, *flags: str) -> Iterator[str]:
    """`headrace serve` on a Unix socket; yields its address once it is healthy."""
    sock = tmp / f"{name}.sock"
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (open for the process's lifetime)
    cmd = [sys.executable, "-m", "daemon.service.cli", "serve", "--host", "", "--uds", str(sock),
           "--quantization", "none", "--no-thread-governor", "--served-model-name", "m",
           "--kv-cache-memory",
           str(512 << 20), *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(sock, proc)
        yield f"unix:{sock}"
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def wait_healthy(sock: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    import socket as s

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"instance exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            c = s.socket(s.AF_UNIX)
            c.connect(str(sock))
            c.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            if b" 200 " in c.recv(64):
                c.close()
                return
            c.close()
        time.sleep(0.5)
    raise TimeoutError("instance did not come up")


async def stream(session: aiohttp.ClientSession, prompt: list[int], n: int) -> list[float]:
    """Arrival times of one streamed completion's chunks."""
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    async with session.post("http://localhost/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


async def measure(address: str, args: argparse.Namespace, loaded: bool) -> Phase:
    """ITL gaps (s) of the streams; with `loaded`, long prompts arrive meanwhile."""
    started = time.time()
    rng = random.Random(1)
    connector = aiohttp.UnixConnector(address.removeprefix("unix:"))
    # No total timeout: on a busy machine a stream can take minutes.
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        shorts = [[rng.randrange(100, 40_000) for _ in range(32)] for _ in range(args.streams)]
        streams = [asyncio.create_task(stream(session, s, args.output_len)) for s in shorts]
        longs = []
        if loaded:
            await asyncio.sleep(args.long_every)
            for _ in range(args.long_prompts):
                prompt = [rng.randrange(100, 40_000) for _ in range(args.long_len)]
                longs.append(asyncio.create_task(stream(session, prompt, 1)))
                await asyncio.sleep(args.long_every)
        results = await asyncio.gather(*streams)
        await asyncio.gather(*longs)
    gaps = [b - a for times in results for a, b in itertools.pairwise(times)]
    return Phase(gaps, started, time.time())


@dataclass
class Phase:
    """One measured run: its ITL gaps and when it ran (wall clock, to find its steps)."""

    gaps: list[float]
    start: float
    end: float
    steps: list[dict] = field(default_factory=list)

    def attach(self, profile: list[dict]) -> None:
        self.steps = [s for s in profile if self.start <= s["t"] <= self.end]

    def step_summary(self) -> str:
        if not self.steps:
            return "no steps profiled"
        step = sorted(s["step_ms"] for s in self.steps)
        commit = max(s.get("kv_commit_ms", 0.0) for s in self.steps)
        prefill = [s["step_ms"] for s in self.steps if s["prefill_tokens"]]
        worst = max(self.steps, key=lambda s: s["step_ms"])
        return (
            f"{len(step)} steps, p50 {step[len(step) // 2]:.1f} ms, max {step[-1]:.1f} ms "
            f"(prefill {worst['prefill_tokens']}, decode {worst['decode_tokens']}; forward "
            f"{worst['forward_ms']:.1f}, prepare {worst['prepare_ms']:.1f}, process "
            f"{worst['process_ms']:.1f}, commit {worst.get('kv_commit_ms', 0.0):.1f}); "
            f"max commit in a step {commit:.1f} ms; "
            f"steps with prompt tokens: {len(prefill)}, max {max(prefill, default=0):.1f} ms"
        )


def read_profile(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def run_front(producer: str, consumer: str, sock: Path) -> web.AppRunner:
    runner = web.AppRunner(PDFrontDoor(producer, consumer).app(), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    return runner


async def both(address: str, args: argparse.Namespace) -> tuple[Phase, Phase]:
    return await measure(address, args, False), await measure(address, args, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=4000)
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--model", help="GGUF file or HF directory (default: embedded SmolLM2)")
    ap.add_argument(
        "--kv-commit-mb-per-step",
        type=float,
        help="the consumer's budget for copying loaded KV in (default: its own)",
    )
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        steps = {name: tmp / f"{name}.steps.jsonl" for name in ("colocated", "consumer")}
        colocated = ["--threads", "2", "--profile-steps", str(steps["colocated"]), *model]
        with instance(tmp, "colocated", *colocated) as address:
            results["colocated"] = asyncio.run(both(address, args))
        kv = str(tmp / "kv.sock")
        peer = ["--threads", "1", "--kv-connector", "peer", "--kv-peer", kv, *model]
        if args.kv_commit_mb_per_step is not None:
            peer += ["--kv-commit-mb-per-step", str(args.kv_commit_mb_per_step)]
        with (
            instance(tmp, "producer", *peer, "--kv-role", "producer") as producer,
            instance(
                tmp, "consumer", *peer, "--kv-role", "consumer",
                "--profile-steps", str(steps["consumer"]),
            ) as consumer,
        ):  # fmt: skip

            async def pd() -> tuple[Phase, Phase]:
                runner = await run_front(producer, consumer, tmp / "front.sock")
                try:
                    return await both(f"unix:{tmp / 'front.sock'}", args)
                finally:
                    await runner.cleanup()

            results["P/D"] = asyncio.run(pd())
        # Read once the instances stopped (their profilers flush on close).
        for name, path in (("colocated", steps["colocated"]), ("P/D", steps["consumer"])):
            profile = read_profile(path)
            for phase in results[name]:
                phase.attach(profile)
    print(cpu_description())
    print(f"{args.streams} streams x {args.output_len} tokens; loaded: {args.long_prompts} "
          f"prompts of {args.long_len} tokens, one every {args.long_every}s")  # fmt: skip
    print(f"{'':10} {'idle p50':>9} {'idle p99':>9} {'load p50':>9} {'load p99':>9} {'ratio':>6}")
    ratios = {}
    for name, (idle_phase, load_phase) in results.items():
        idle, load = idle_phase.gaps, load_phase.gaps
        ratios[name] = p(load, 0.99) / p(idle, 0.99)
        print(f"{name:10} {p(idle, 0.5):9.1f} {p(idle, 0.99):9.1f} {p(load, 0.5):9.1f} "
              f"{p(load, 0.99):9.1f} {ratios[name]:6.2f}")  # fmt: skip
    print("steps of the decoding instance (colocated; P/D: the consumer):")
    for name, (idle_phase, load_phase) in results.items():
        print(f"  {name:10} idle:   {idle_phase.step_summary()}")
        print(f"  {name:10} loaded: {load_phase.step_summary()}")
    co_idle, co_load = (phase.gaps for phase in results["colocated"])
    pd_idle, pd_load = (phase.gaps for phase in results["P/D"])
    print(
        f"RESULT pd_loaded_over_idle_p99={ratios['P/D']:.2f} "
        f"colocated_loaded_over_idle_p99={ratios['colocated']:.2f} "
        f"pd_itl_p99_ms={p(pd_load, 0.99):.1f} colocated_itl_p99_ms={p(co_load, 0.99):.1f} "
        f"pd_idle_p99_ms={p(pd_idle, 0.99):.1f} colocated_idle_p99_ms={p(co_idle, 0.99):.1f}"
    )


if __name__ == "__main__":
    main()
