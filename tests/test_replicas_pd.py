"""P/D as a mode of the data-parallel router: `headrace serve --prefill-replicas 1
--decode-replicas 1` on a tiny model.

One daemon for the module (front door, one producer replica, one consumer replica): greedy
text equals one in-process engine's, the consumer loads each prompt's KV from the producer
(through shared memory), one SSE stream per request; a killed producer costs only speed
(the consumer computes the prompt it had) and it rejoins; no replica holds a block once idle.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from daemon_fixtures import Daemon
from reliability_fixtures import build_tiny_model_dir
from test_replicas import _metric, _replica_pids

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from scheduling import SamplingParams

KV = str(8 << 20)
MAX_TOKENS = 8
# 40-token prompts: ten full blocks of 4, new to both replicas each time.
PROMPTS = [list(range(10 + 50 * i, 50 + 50 * i)) for i in range(5)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("pd-model"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[str]:
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            quantization="none",
            threads=1,
            kv_cache_memory=int(KV),
            max_model_len=512,
            block_size=4,
        )
    )
    return [c.text for c in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def pd(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("pd"),
        "--model",
        str(model_dir),
        "--prefill-replicas",
        "1",
        "--decode-replicas",
        "1",
        "--kv-cache-memory",
        KV,
        "--max-model-len",
        "512",
        "--block-size",
        "4",
    )
    yield d
    d.stop()


def complete(client: httpx.Client, prompt: list[int]) -> tuple[str, int]:
    """(text, cached prompt tokens) of one streamed completion: one SSE stream."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("error" not in e for e in events), events
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    details = events[-1]["usage"].get("prompt_tokens_details") or {}
    return text, details.get("cached_tokens", 0)


def metrics_when(d: Daemon, key: str, at_least: float) -> str:
    """/metrics once `key` reaches `at_least` (replicas report every 20 ms), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{d.url}/metrics", timeout=30).text
        if _metric(text, key) >= at_least or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_router_pd_greedy_text_equals_one_engine(pd: Daemon, reference: list[str]) -> None:
    with pd.http() as client:
        got = [complete(client, p) for p in PROMPTS[:3]]
    assert [text for text, _ in got] == reference[:3]
    # Each prompt's KV came from the producer: the consumer computed only its last token.
    assert all(cached >= 36 for _, cached in got), got
    shm = 'headrace_kv_connector_transfers_total{path="shm"}'
    text = metrics_when(pd, shm, 3)
    assert _metric(text, 'headrace_router_pd_prefills_total{outcome="ok"}') == 3
    assert _metric(text, shm) == 3
    assert _metric(text, 'headrace_kv_connector_load_failures_total{kind="peer_down"}') == 0


def _producer_pid(daemon_pid: int) -> int:
    """The replica process listening on the producer's KV socket (kv-0.sock)."""
    inodes = {
        fields[6]
        for fields in (line.split() for line in Path("/proc/net/unix").read_text().splitlines())
        if len(fields) >= 8 and fields[7].endswith("/kv-0.sock")
    }
    for pid in _replica_pids(daemon_pid):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                    return pid
            except OSError:
                continue
    raise AssertionError("no replica serves kv-0.sock")


def test_a_killed_producer_still_answers_right_and_nothing_leaks(
    pd: Daemon, reference: list[str]
) -> None:
    victim = _producer_pid(pd.proc.pid)
    # Stopped, the producer still looks up: the next prompt goes to it, and it dies with the
    # prompt in hand. The consumer computes it.
    os.kill(victim, signal.SIGSTOP)
    with pd.http() as client, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, client, PROMPTS[3])
        time.sleep(1.0)
        assert not answer.done()
        os.kill(victim, signal.SIGKILL)
        assert answer.result(60)[0] == reference[3]
        deadline = time.monotonic() + 60
        while client.get("/health").json()["replicas_down"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/health").json()["replicas_down"] == [], "no rejoin within 60 s"
        text, cached = complete(client, PROMPTS[4])  # through the restarted producer
    assert text == reference[4] and cached >= 36
    metrics = metrics_when(pd, 'headrace_router_pd_prefills_total{outcome="ok"}', 4)
    assert _metric(metrics, 'headrace_router_pd_prefills_total{outcome="failed"}') == 1
    assert _metric(metrics, 'headrace_router_pd_prefills_total{outcome="ok"}') == 4
    assert victim not in _replica_pids(pd.proc.pid)
    # Idle: no replica holds a KV block, and none logged a failed integrity check.
    for replica in (0, 1):
        usage = f'headrace_replica_kv_cache_usage{{replica="{replica}"}}'
        deadline = time.monotonic() + 10
        while _metric(metrics, usage) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            metrics = httpx.get(f"{pd.url}/metrics", timeout=30).text
        assert _metric(metrics, usage) == 0, usage
    assert "KV cache check failed" not in pd.log.read_text()
