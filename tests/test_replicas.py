"""Data-parallel serving end to end: `headrace serve --data-parallel-size 2` on a tiny model.

One daemon for the module (front door + two replica processes, a LoRA adapter on each):
greedy text equals the in-process engine's (base and adapters), adapters load and unload at
run time on every replica, /health and /metrics name the replicas, kill -9 of a replica
fails only its own streams and it rejoins, SIGTERM drains and takes every replica with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_fixtures import Daemon
from lora_fixtures import make_peft_adapter
from reliability_fixtures import build_tiny_model_dir

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer
from scheduling import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5", "Hello there, friend"]
MAX_TOKENS = 8
KV = str(8 << 20)
# Long enough that a stream is still running when the test acts on it.
LONG = 480


LORA = ("--max-loras", "2", "--max-lora-rank", "8", "--enable-lora-runtime-updates")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, with peft adapters `one` and `two` for it beside it."""
    d = tmp_path_factory.mktemp("dp-model")
    build_tiny_model_dir(d / "base")
    tokenizer = load_tokenizer(resolve_model(None))
    overrides = dict(
        vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id
    )
    for name, seed in (("one", 1), ("two", 2)):
        make_peft_adapter("llama-plain", d / name, seed, r=4, model_overrides=overrides)
    return d / "base"


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Engine:
    """The same model and adapters in one in-process engine (DP=1)."""
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            quantization="none",
            threads=1,
            kv_cache_memory=int(KV),
            max_model_len=512,
            block_size=4,
            lora_modules=(f"one={model_dir.parent / 'one'}", f"two={model_dir.parent / 'two'}"),
            max_loras=2,
            max_lora_rank=8,
        )
    )


@pytest.fixture(scope="module")
def dp(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("dp"),
        "--model",
        str(model_dir),
        "--data-parallel-size",
        "2",
        "--kv-cache-memory",
        KV,
        "--max-model-len",
        "512",
        "--block-size",
        "4",
        "--lora-modules",
        f"one={model_dir.parent / 'one'}",
        *LORA,
    )
    yield d
    d.stop()


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (a process started from a worker thread counts)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def _replica_pids(daemon_pid: int) -> list[int]:
    """The replica processes: children of the daemon's multiprocessing forkserver."""
    for child in _children(daemon_pid):
        if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
            return _children(child)
    return []


def _gauge(text: str, name: str, replica: int) -> float:
    prefix = f'{name}{{replica="{replica}"}} '
    return next(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _complete(client: httpx.Client, prompt: str, model: str | None = None) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "model": model} if model else body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model or model is None
    return r.json()["choices"][0]["text"]


def test_dp2_greedy_text_equals_one_engine(dp: Daemon, reference: Engine) -> None:
    expected = [c.text for c in reference.generate(PROMPTS, GREEDY)]
    with dp.http() as client:
        # The second round's prompts hit the prefix cache of the replica that holds them.
        got = [_complete(client, p) for p in PROMPTS * 2]
    assert got == expected * 2


def test_cache_aware_sends_a_shared_prefix_to_its_holder(dp: Daemon) -> None:
    """Each follow-up shares its system prompt with the request before it: cache_aware
    sends it where that prefix is cached (round robin would alternate replicas)."""
    before = httpx.get(f"{dp.url}/metrics", timeout=30).text
    cached = []
    with dp.http() as client:
        for i in range(4):
            system = list(range(10 + 40 * i, 50 + 40 * i))  # 40 tokens: 10 full blocks
            for follow_up in ([7, 8], [9, 10, 11]):
                r = client.post(
                    "/v1/completions",
                    json={"prompt": system + follow_up, "max_tokens": 2, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                details = r.json()["usage"].get("prompt_tokens_details") or {}
                cached.append(details.get("cached_tokens", 0))
    assert cached[1::2] == [40] * 4, cached  # every follow-up found its whole prefix
    after = httpx.get(f"{dp.url}/metrics", timeout=30).text
    hits = [
        _metric(t, 'headrace_router_requests_total{policy="cache_aware",reason="cache_hit"}')
        for t in (before, after)
    ]
    assert hits[1] - hits[0] >= 4
    predicted = [
        _metric(t, "headrace_router_predicted_cached_tokens_total") for t in (before, after)
    ]
    assert predicted[1] - predicted[0] >= 4 * 40


def _metric(text: str, key: str) -> float:
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_adapters_are_served_on_every_replica_and_load_at_run_time(
    dp: Daemon, reference: Engine, model_dir: Path
) -> None:
    one = [c.text for c in reference.generate(PROMPTS, GREEDY, loras=["one"] * len(PROMPTS))]
    two = [c.text for c in reference.generate(PROMPTS, GREEDY, loras=["two"] * len(PROMPTS))]
    base = [c.text for c in reference.generate(PROMPTS, GREEDY)]
    assert one != base and two != one  # the adapters change the text
    two_dir = str(model_dir.parent / "two")
    with dp.http() as client:
        models = client.get("/v1/models").json()["data"]
        base_id = models[0]["id"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base_id, None), ("one", base_id)]
        # cache_aware sends each new prompt where there is most room: they spread out.
        assert [_complete(client, p, "one") for p in PROMPTS * 2] == one * 2

        r = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": two_dir})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "two" and r.json()["parent"] == base_id
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == [base_id, "one", "two"]
        assert [_complete(client, p, "two") for p in PROMPTS * 2] == two * 2

        # As one engine answers: a name served already and a bad file are 400s naming the
        # field, and nothing changes.
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": two_dir})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        missing = str(model_dir.parent / "nowhere")
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": missing})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert "nowhere" in r.json()["error"]["message"]
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ids

        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
        assert r.status_code == 200, r.text
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        body = {"prompt": PROMPTS[0], "max_tokens": 2, "model": "two"}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert [_complete(client, p, "one") for p in PROMPTS] == one  # the others still serve
        assert [_complete(client, p) for p in PROMPTS] == base


def _per_replica(text: str, name: str) -> list[float]:
    return [_gauge(text, name, i) for i in (0, 1)]


def test_metrics_count_prefix_cache_hits_per_replica(dp: Daemon) -> None:
    queries, hits = (
        "headrace_replica_prefix_cache_queries_tokens_total",
        "headrace_replica_prefix_cache_hits_tokens_total",
    )
    before = httpx.get(f"{dp.url}/metrics", timeout=30).text
    system = list(range(300, 340))  # 10 full blocks, new to both replicas
    with dp.http() as client:
        for follow_up in ([7, 8], [9, 10, 11]):
            body = {"prompt": system + follow_up, "max_tokens": 2, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 10
    while True:  # a replica's figures reach the front door with its next Load (20 ms)
        after = httpx.get(f"{dp.url}/metrics", timeout=30).text
        looked_up = [b - a for a, b in zip(*(_per_replica(t, queries) for t in (before, after)))]
        if sum(looked_up) >= 85 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    served = [b - a for a, b in zip(*(_per_replica(t, hits) for t in (before, after)))]
    # Both went to the replica holding the prefix: it looked up 42 + 43 tokens and found the
    # 40 of the system prompt once; the other replica counted nothing.
    holder = looked_up.index(max(looked_up))
    assert looked_up[holder] == 85 and looked_up[1 - holder] == 0, looked_up
    assert served[holder] == 40 and served[1 - holder] == 0, served


def test_health_and_metrics_name_the_replicas(dp: Daemon) -> None:
    body = httpx.get(f"{dp.url}/health", timeout=30).json()
    assert body == {"status": "ok", "replicas": 2, "replicas_down": []}
    text = httpx.get(f"{dp.url}/metrics", timeout=30).text
    assert 'headrace_replica_up{replica="0"} 1.0' in text
    assert 'headrace_replica_up{replica="1"} 1.0' in text
    routed = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('headrace_router_requests_total{policy="cache_aware"')
    ]
    assert sum(routed) >= 8


async def _stream(
    client: httpx.AsyncClient, prompt: str, tokens: int, started: asyncio.Semaphore | None = None
) -> tuple[str, str]:
    """("ok", text) or ("error", message) for one SSE completion; `started` is released at
    its first token."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return "error", (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error", event["error"]["message"]
            if not text and started is not None:
                started.release()
            text += event["choices"][0]["text"]
    return "ok", text


def test_kill_one_replica_mid_stream_fails_only_its_requests(dp: Daemon) -> None:
    replicas = _replica_pids(dp.proc.pid)
    assert len(replicas) == 2
    victim = replicas[0]
    running: list[float] = []
    downs: list[int] = []

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=dp.url, timeout=120) as client:
            started = asyncio.Semaphore(0)
            tasks = [
                asyncio.create_task(_stream(client, f"story {i}", LONG, started)) for i in range(8)
            ]
            for _ in tasks:  # every stream has its first token
                await started.acquire()
            # The gauge follows the replicas' load reports, which lag by a report interval.
            deadline = time.monotonic() + 10
            while not running or (sum(running) < 8 and time.monotonic() < deadline):
                await asyncio.sleep(0.05)
                text = (await client.get("/metrics")).text
                gauge = "headrace_replica_requests_running"
                running[:] = [_gauge(text, gauge, i) for i in (0, 1)]
            os.kill(victim, signal.SIGKILL)
            while not downs:  # /health names the victim (it is back a few seconds later)
                health = await client.get("/health")
                assert health.status_code == 200  # the other replica still serves
                downs.extend(health.json()["replicas_down"])
                await asyncio.sleep(0.02)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    results = asyncio.run(run())
    failed = [m for kind, m in results if kind == "error"]
    done = [t for kind, t in results if kind == "ok"]
    [down] = downs
    # Exactly the victim's streams fail, with the OpenAI-shaped error; the rest complete.
    assert sum(running) == 8 and running[down] >= 1, running
    assert len(failed) == running[down], results
    assert all(f"replica {down} failed" in m for m in failed), failed
    assert len(done) == 8 - len(failed) and all(len(t) > 0 for t in done)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{dp.url}/health", timeout=30)
        if health.json()["replicas_down"] == []:
            break
        assert health.status_code == 200
        time.sleep(0.2)
    assert health.json()["replicas_down"] == [], "the replica did not rejoin within 30 s"
    assert victim not in _replica_pids(dp.proc.pid) and len(_replica_pids(dp.proc.pid)) == 2
    with dp.http() as client:
        assert all(_complete(client, p) for p in PROMPTS)  # both replicas serve again
    text = httpx.get(f"{dp.url}/metrics", timeout=30).text
    assert _gauge(text, "headrace_replica_restarts_total", down) == 1


def test_sigterm_drains_every_replica_and_exits_zero(dp: Daemon) -> None:
    replicas = _replica_pids(dp.proc.pid)
    assert len(replicas) == 2

    async def run() -> tuple[str, str]:
        async with httpx.AsyncClient(base_url=dp.url, timeout=120) as client:
            started = asyncio.Semaphore(0)
            task = asyncio.create_task(_stream(client, "drain me", LONG, started))
            await started.acquire()
            dp.proc.send_signal(signal.SIGTERM)
            return await task

    assert asyncio.run(run())[0] == "ok"  # the in-flight stream finished
    assert dp.proc.wait(60) == 0
    assert "STOPPING=1" in "\n".join(dp.notify.messages)
    for pid in replicas:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True
