"""The Ray backend on a local single-machine cluster bound to loopback: two replica actors
behind a ReplicaSet return the in-process engine's greedy text, an actor killed by Ray
comes back (Ray restarts it; the front door reconnects), and an actor whose worker process
is SIGKILLed mid-stream fails only its own streams with the OpenAI-shaped error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import pytest
import ray  # the ray extra is part of `make test`'s set-up: this test runs in CI
from aiohttp.test_utils import TestClient, TestServer
from reliability_fixtures import build_tiny_model_dir

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.openai.api import APIServer
from daemon.openai.metrics import Metrics
from daemon.replicas.replica_set import ReplicaSet
from daemon.replicas.routing import make_router
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer
from scheduling import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model = build_tiny_model_dir(tmp_path_factory.mktemp("ray-model"))
    return EngineConfig(
        model=str(model),
        dtype="float32",
        quantization="none",
        threads=1,
        kv_cache_memory=4 << 20,
        max_model_len=256,
        block_size=4,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # Workers import daemon.replicas from the editable install, like any Ray job's code.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    yield
    ray.shutdown()


async def _text(replicas: ReplicaSet, prompt: list[int]) -> list[int]:
    ids: list[int] = []
    async for delta in replicas.add_request(prompt, PARAMS):
        ids += delta.new_token_ids
    return ids


def test_two_ray_actors_serve_the_engines_greedy_tokens(
    cluster: None, config: EngineConfig
) -> None:
    from daemon.replicas.ray_backend import RayBackend

    engine = Engine(config)
    expected = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]

    async def run() -> tuple[list[list[int]], list[int]]:
        backend = RayBackend(2, 1, None)
        replicas = ReplicaSet(
            config, 2, backend, make_router("round_robin", config, 2), overlap=False
        )
        await replicas.open(load_tokenizer(resolve_model(config.model)))
        try:
            got = await asyncio.gather(*(_text(replicas, p) for p in PROMPTS))
            used = sorted({s.index for s in replicas.stats().replicas if s.healthy})
            # Ray restarts a killed actor; the front door sees it down, then back.
            ray.kill(backend.actors[0], no_restart=False)
            for _ in range(600):
                await asyncio.sleep(0.1)
                if replicas.replicas[0].restarts and replicas.replicas[0].healthy:
                    break
            assert replicas.replicas[0].healthy and replicas.replicas[0].restarts == 1
            got.append(await _text(replicas, PROMPTS[0]))
            got.append(await _text(replicas, PROMPTS[0]))
            return got, used
        finally:
            await replicas.stop()

    got, used = asyncio.run(run())
    assert used == [0, 1]
    assert got == [*expected, expected[0], expected[0]]


async def _sse(client: TestClient, prompt: list[int], started: asyncio.Semaphore) -> tuple:
    """("ok", tokens) or ("error", message) for one streamed completion over the API."""
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json={**body, "stream": True})
    assert r.status == 200
    chunks = 0
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return "error", event["error"]["message"]
        chunks += 1
        if chunks == 1:
            started.release()
    return "ok", chunks


def test_sigkill_of_an_actors_process_fails_only_its_streams(
    cluster: None, config: EngineConfig
) -> None:
    from daemon.replicas.ray_backend import RayBackend

    async def run() -> tuple[list[tuple], int, list[int]]:
        backend = RayBackend(2, 1, None)
        replicas = ReplicaSet(config, 2, backend, make_router("round_robin", config, 2), False)
        await replicas.open(load_tokenizer(resolve_model(config.model)))
        client = TestClient(TestServer(APIServer(replicas, "tiny", Metrics()).app()))
        await client.start_server()
        try:
            victim = replicas.replicas[0].channel.pid
            assert victim and victim != os.getpid()  # the actor's own worker process
            started = asyncio.Semaphore(0)
            tasks = [asyncio.create_task(_sse(client, [20 + i, 21, 22], started)) for i in range(4)]
            for _ in tasks:
                await started.acquire()
            on_victim = len(replicas.replicas[0].streams)
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for _ in range(1200):  # Ray restarts the actor; the front door reconnects
                if replicas.replicas[0].healthy:
                    break
                await asyncio.sleep(0.1)
            assert replicas.replicas[0].healthy and replicas.replicas[0].restarts == 1
            assert replicas.replicas[0].channel.pid != victim
            after = [await _text(replicas, PROMPTS[0]) for _ in range(2)]  # both replicas
            return results, on_victim, [len(ids) for ids in after]
        finally:
            await client.close()
            await replicas.stop()

    results, on_victim, after = asyncio.run(run())
    failed = [m for kind, m in results if kind == "error"]
    assert on_victim == 2 and len(failed) == 2, results
    assert all("replica 0 failed" in m for m in failed), failed
    assert [kind for kind, n in results if n and kind == "ok"] == ["ok", "ok"]  # the others end
    assert after == [PARAMS.max_tokens] * 2
