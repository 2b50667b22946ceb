"""KV connector figures in /metrics, read from a live engine with the disk tier."""

from __future__ import annotations

import pytest
from reliability_fixtures import api_client, build_tiny_model_dir, load_tiny, wait_idle

from daemon.engine.loaded_model import LoadedModel

BODY = {"model": "tiny", "prompt": list(range(100, 142)), "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_tiny(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample in a text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def completion_and_metrics(client, api) -> tuple[str, dict[str, float]]:
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status == 200, await resp.text()
    text = (await resp.json())["choices"][0]["text"]
    await wait_idle(api.engine)
    api.engine.engine.kv_connector.worker.flush()  # the saves are written off the step
    return text, samples(await (await client.get("/metrics")).text())


async def test_metrics_count_what_the_disk_tier_saves_loads_and_rejects(
    loaded, tmp_path, monkeypatch
):
    monkeypatch.setenv("HEADRACE_CACHE_DIR", str(tmp_path))
    async with api_client(loaded, kv_connector="disk") as (client, api):
        payload = api.engine.engine.kv_connector.worker.ctx.payload_len
        first, m = await completion_and_metrics(client, api)
    api.engine.engine.close()
    # 42 prompt tokens in blocks of 4: ten full blocks, each saved once
    assert m["headrace_kv_connector_saved_blocks_total"] == 10
    assert m["headrace_kv_connector_saved_tokens_total"] == 40
    assert m["headrace_kv_connector_saved_bytes_total"] == 10 * payload
    assert m["headrace_kv_connector_store_bytes"] > 10 * payload  # payloads + headers
    assert m["headrace_kv_connector_loaded_tokens_total"] == 0
    assert m["headrace_kv_connector_load_seconds_count"] == 0
    assert m['headrace_kv_connector_load_failures_total{kind="corrupt"}'] == 0

    files = sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert len(files) == 10
    block_hashes = _hashes(api)
    victim = next(p for p in files if p.name == block_hashes[6])
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: its crc no longer matches
    victim.write_bytes(bytes(data))
    async with api_client(loaded, kv_connector="disk") as (client, api):
        again, m = await completion_and_metrics(client, api)
    api.engine.engine.close()
    assert again == first
    # blocks 0-5 loaded; 6 is corrupt (so 7-9 are unusable) and is recomputed
    assert m["headrace_kv_connector_loaded_blocks_total"] == 6
    assert m["headrace_kv_connector_loaded_tokens_total"] == 24
    assert m["headrace_kv_connector_loaded_bytes_total"] == 6 * payload
    assert m['headrace_kv_connector_load_failures_total{kind="corrupt"}'] == 1
    assert m['headrace_kv_connector_load_failures_total{kind="missing"}'] == 0
    assert m["headrace_kv_connector_load_seconds_count"] == 1
    assert m["headrace_kv_connector_saved_blocks_total"] == 4  # 6 (rewritten) to 9


def _hashes(api) -> list[str]:
    from kvcache.block_hash import hash_request_blocks

    kv = api.engine.engine.kv
    out: list[bytes] = []
    hash_request_blocks(kv.hash_fn, kv.block_size, BODY["prompt"], out, None)
    return [h.hex() for h in out]


async def test_an_engine_without_a_connector_shows_no_connector_metrics(loaded):
    async with api_client(loaded) as (client, _):
        text = await (await client.get("/metrics")).text()
    assert "headrace_kv_connector" not in text
