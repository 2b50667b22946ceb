"""KV connectors end to end on a tiny model: the disk tier and P/D give the colocated text."""

from __future__ import annotations

import mmap
import random
import sys
from pathlib import Path

import pytest
from model_fixtures import engine_for as _engine_for
from model_fixtures import make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from daemon.openai.metrics import Metrics
from daemon.service.serve_config import parse_serve_args
from plugins import KV_CONNECTOR_GROUP, PluginError, UnknownPluginError, load_kv_connector
from scheduling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = random.Random(3).choices(range(3, 300), k=70)  # four full blocks of 16, then 6


def engine_for(loaded: LoadedModel, **cfg: object) -> Engine:
    cfg.setdefault("kv_cache_memory", 1 << 22)  # 4 MiB: a 1 GiB default pool is slow to zero
    return _engine_for(loaded, **cfg)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama", directory)
    return LoadedModel.load(EngineConfig(model=str(directory), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def colocated(tiny) -> list[int]:
    (done,) = engine_for(tiny).generate([PROMPT], GREEDY)
    return done.token_ids


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HEADRACE_CACHE_DIR", str(tmp_path))
    return tmp_path


def run(engine: Engine, params: SamplingParams = GREEDY):
    (done,) = engine.generate([PROMPT], params)
    assert engine.check_idle()
    assert engine.kv_connector is None or engine.kv_connector.worker.num_staged() == 0
    return done


def block_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "kv").rglob("*") if p.is_file())


def test_disk_tier_survives_a_restart_with_the_same_text(tiny, colocated, cache):
    first = engine_for(tiny, kv_connector="disk")
    done = run(first)
    assert done.token_ids == colocated and done.cached_tokens == 0
    first.close()
    assert len(block_files(cache)) == 4  # the prompt's full blocks, one file each
    restarted = engine_for(tiny, kv_connector="disk")
    done = run(restarted)
    assert done.token_ids == colocated
    assert done.cached_tokens == 64
    assert restarted.kv_connector.worker.num_loaded_blocks == 4
    restarted.close()


def test_int8_rows_survive_a_restart_and_are_foreign_to_float_rows(tiny, cache):
    # An int8 cache's rows carry their scales (runner/kv_format.py): a block is still one copy.
    first = engine_for(tiny, kv_connector="disk", kv_cache_dtype="int8")
    want = run(first).token_ids
    first.close()
    assert len(block_files(cache)) == 4
    # The layout names the rows' dtype: an engine of float rows finds none of these.
    floats = engine_for(tiny, kv_connector="disk")
    assert run(floats).cached_tokens == 0
    floats.close()
    restarted = engine_for(tiny, kv_connector="disk", kv_cache_dtype="int8")
    done = run(restarted)
    assert done.token_ids == want and done.cached_tokens == 64
    assert restarted.kv_connector.worker.num_loaded_blocks == 4
    restarted.close()


def test_a_corrupt_block_is_recomputed_and_never_used(tiny, colocated, cache):
    engine = engine_for(tiny, kv_connector="disk")
    run(engine)
    engine.close()
    files = {p.name: p for p in block_files(cache)}
    engine = engine_for(tiny, kv_connector="disk")
    hashes = _prompt_hashes(engine)
    victim = files[hashes[2].hex()]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit of the payload: the checksum catches it
    victim.write_bytes(bytes(data))
    done = run(engine)
    assert done.token_ids == colocated
    assert done.cached_tokens == 32  # blocks 0 and 1; 2 is bad, so 3 is unusable too
    assert engine.kv_connector.store.num_corrupt == 1
    engine.close()
    assert victim.exists()  # rewritten, intact, by the recompute
    files[hashes[0].hex()].write_bytes(victim.read_bytes()[:100])  # truncated
    engine = engine_for(tiny, kv_connector="disk")
    done = run(engine)
    assert done.token_ids == colocated and done.cached_tokens == 0
    engine.close()


def test_another_models_blocks_are_foreign(tiny, colocated, cache, tmp_path_factory):
    engine = engine_for(tiny, kv_connector="disk")
    run(engine)
    engine.close()
    directory = tmp_path_factory.mktemp("other")
    make_tiny_hf_model("llama", directory, initializer_range=0.3)
    other = LoadedModel.load(EngineConfig(model=str(directory), device="cpu", dtype="float32"))
    engine = engine_for(other, kv_connector="disk")
    done = run(engine)
    assert done.cached_tokens == 0  # another weights fingerprint: another namespace
    engine.close()
    assert len({p.parent.parent for p in block_files(cache)}) == 2


def mapped_segments() -> int:
    """Shared-memory KV segments mapped in this process now."""
    return Path("/proc/self/maps").read_text().count("memfd:headrace-kv")


@pytest.mark.parametrize("shm", [True, False])
def test_pd_consumer_decodes_the_producers_prompt_kv(tiny, colocated, tmp_path, shm):
    address = str(tmp_path / "kv.sock")
    peer = {"kv_connector": "peer", "kv_peer": address, "kv_peer_shm": shm}
    producer = engine_for(tiny, kv_role="producer", **peer)
    consumer = engine_for(tiny, kv_role="consumer", **peer)
    try:
        first = run(producer, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        assert first.token_ids == colocated[:1]
        done = run(consumer)
        assert done.token_ids == colocated
        assert done.cached_tokens == 64
        path = "shm" if shm else "socket"
        assert consumer.kv_connector.worker.store.transfers == {path: 1}
        assert producer.kv_connector.server.replies == {path: 1}
        text = Metrics().render(consumer.stats()).decode()
        assert f'headrace_kv_connector_transfers_total{{path="{path}"}} 1.0' in text
        assert mapped_segments() == 0  # each block's view dropped once copied in
        # The consumer's own prefix cache now serves the prompt without the producer.
        producer.close()
        again = run(consumer)
        assert again.token_ids == colocated and again.cached_tokens == 64
    finally:
        producer.close()
        consumer.close()


def test_pd_unmappable_segment_is_recomputed_then_the_socket_serves(
    tiny, colocated, tmp_path, monkeypatch
):
    address = str(tmp_path / "kv.sock")
    producer = engine_for(tiny, kv_connector="peer", kv_role="producer", kv_peer=address)
    consumer = engine_for(tiny, kv_connector="peer", kv_role="consumer", kv_peer=address)
    try:
        run(producer, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))

        def no_memory(*args: object, **kwargs: object) -> None:
            raise OSError(12, "Cannot allocate memory")

        with monkeypatch.context() as m:
            m.setattr(mmap, "mmap", no_memory)
            done = run(consumer)
        assert done.token_ids == colocated and done.cached_tokens == 0
        store = consumer.kv_connector.worker.store
        assert store.failures == {"shm": 1} and not store.get(address).shm
        # Another prompt with the same start: the producer's blocks now come on the socket.
        other = PROMPT[:48] + [7] * 30
        run_prompt(producer, other, max_tokens=1)
        (alone,) = engine_for(tiny).generate([other], GREEDY)
        again = run_prompt(consumer, other)
        assert again.token_ids == alone.token_ids and again.cached_tokens == 64
        assert store.transfers == {"socket": 1}
    finally:
        producer.close()
        consumer.close()


def run_prompt(engine: Engine, prompt: list[int], max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (done,) = engine.generate([prompt], params)
    assert engine.check_idle()
    return done


def run_from(engine: Engine, prompt: list[int], kv_source: str | None) -> tuple[list[int], int]:
    """(tokens, cached tokens) of `prompt`, its KV loaded from the producer at `kv_source`."""
    rid = engine.add_request(prompt, GREEDY, kv_source=kv_source)
    tokens, cached = [], -1
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.request_id == rid:
                tokens += d.new_token_ids
                cached = d.num_cached_tokens if d.finished else cached
    engine.release_finished()
    assert engine.check_idle()
    return tokens, cached


def test_pd_consumer_pulls_from_the_producer_each_request_names(tiny, colocated, tmp_path):
    a, b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    producers = [
        engine_for(tiny, kv_connector="peer", kv_role="producer", kv_peer=x) for x in (a, b)
    ]
    consumer = engine_for(tiny, kv_connector="peer", kv_role="consumer")  # no --kv-peer
    prompts = [PROMPT, PROMPT[::-1]]
    (reverse,) = engine_for(tiny).generate([prompts[1]], GREEDY)
    try:
        for producer, prompt in zip(producers, prompts):
            run_prompt(producer, prompt, max_tokens=1)
        for address, prompt, want in zip((a, b), prompts, (colocated, reverse.token_ids)):
            assert run_from(consumer, prompt, address) == (want, 64)
        peers = consumer.kv_connector.worker.store
        assert peers.get(a).transfers == {"shm": 1} and peers.get(b).transfers == {"shm": 1}
        assert peers.transfers == {"shm": 2}
        # Naming no producer, on a consumer started without one: it computes the prompt.
        tokens, cached = run_from(consumer, [9] * 40, None)
        assert len(tokens) == GREEDY.max_tokens and cached == 0 and peers.num_failed == 0
    finally:
        for engine in (*producers, consumer):
            engine.close()


def test_pd_dead_producer_makes_the_consumer_recompute(tiny, colocated, tmp_path):
    consumer = engine_for(
        tiny, kv_connector="peer", kv_role="consumer", kv_peer=str(tmp_path / "nobody.sock")
    )
    done = run(consumer)
    assert done.token_ids == colocated and done.cached_tokens == 0
    assert consumer.kv_connector.worker.store.num_failed == 1
    text = Metrics().render(consumer.stats()).decode()
    assert 'headrace_kv_connector_load_failures_total{kind="peer_down"} 1.0' in text
    assert "headrace_kv_connector_loaded_blocks_total 0.0" in text
    consumer.close()


def test_connectors_are_plugins_checked_by_name_and_role(tiny, cache):
    with pytest.raises(UnknownPluginError, match="installed: disk, peer"):
        load_kv_connector("nvme", None)
    with pytest.raises(ValueError, match="kv_role"):
        engine_for(tiny, kv_connector="peer", kv_peer="/tmp/x.sock")
    with pytest.raises(ValueError, match="sha256"):
        engine_for(tiny, kv_connector="disk", prefix_cache_hash="builtin")
    assert issubclass(UnknownPluginError, PluginError)


def _prompt_hashes(engine: Engine) -> list[bytes]:
    from kvcache.block_hash import hash_request_blocks

    out: list[bytes] = []
    hash_request_blocks(engine.kv.hash_fn, engine.kv.block_size, PROMPT, out, None)
    return out


def test_abort_while_loading_leaves_nothing_staged_or_held(tiny, cache):
    first = engine_for(tiny, kv_connector="disk")
    run(first)
    first.close()
    engine = engine_for(tiny, kv_connector="disk")
    rid = engine.add_request(PROMPT, GREEDY)
    so = engine.schedule()  # admitted into WAITING_FOR_KV: blocks held, the load started
    assert so.is_empty and so.kv_connector_meta.loads
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort([rid])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.release_finished()  # the runner side drops the load
    worker = engine.kv_connector.worker
    assert not worker.has_inflight() and worker.num_staged() == 0
    assert engine.check_idle()
    engine.close()


RAM_TIER = """
from kvcache.connectors import KV_CONNECTOR_API_VERSION, MemoryStore, StoreLookup
from runner.kv_connectors import StoreWorker

STORES = {}


class RamTier:
    name = "ram"
    api_version = API

    def __init__(self, ctx):
        store = STORES.setdefault(ctx.layout.key, MemoryStore(ctx.layout, ctx.payload_len, 1 << 24))
        self.scheduler = StoreLookup(ctx.layout, store)
        self.worker = StoreWorker(ctx, store)

    def close(self):
        self.worker.close()
"""


def fake_connector(root: Path, monkeypatch, api: str) -> None:
    """A third-party connector package as pip would leave it: module + entry_points.txt."""
    (root / "ram_tier.py").write_text(RAM_TIER.replace("api_version = API", f"api_version = {api}"))
    info = root / "ram_tier-0.1.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: ram_tier\nVersion: 0.1.0\n")
    info.joinpath("entry_points.txt").write_text(
        f"[{KV_CONNECTOR_GROUP}]\nram = ram_tier:RamTier\n"
    )
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "ram_tier", raising=False)


def test_a_third_party_connector_plugs_in_by_entry_point(tiny, colocated, tmp_path, monkeypatch):
    fake_connector(tmp_path, monkeypatch, "KV_CONNECTOR_API_VERSION")
    first = engine_for(tiny, kv_connector="ram")
    assert run(first).cached_tokens == 0
    first.close()
    second = engine_for(tiny, kv_connector="ram")  # another engine, the same RAM tier
    done = run(second)
    assert done.token_ids == colocated and done.cached_tokens == 64
    second.close()


def test_a_connector_for_another_api_version_is_refused(tiny, tmp_path, monkeypatch):
    fake_connector(tmp_path, monkeypatch, "99")
    with pytest.raises(PluginError, match=r"version 99.*supports version 1"):
        engine_for(tiny, kv_connector="ram")


def test_serve_flags_reach_the_engine_config():
    engine = parse_serve_args(
        [
            "--kv-connector",
            "peer",
            "--kv-role",
            "consumer",
            "--kv-peer",
            "10.0.0.2:7000",
            "--kv-store-gb",
            "0.5",
        ]
    ).engine
    assert (engine.kv_connector, engine.kv_role, engine.kv_peer) == (
        "peer",
        "consumer",
        "10.0.0.2:7000",
    )
    assert engine.kv_store_gb == 0.5


def test_a_load_is_copied_in_a_block_a_step_while_another_request_decodes(tiny, colocated, cache):
    first = engine_for(tiny, kv_connector="disk")
    run(first)
    first.close()
    # 1 byte a step: the budget rounds up to one block per step while others run
    engine = engine_for(tiny, kv_connector="disk", kv_commit_mb_per_step=1e-6)
    worker = engine.kv_connector.worker
    assert worker.commit_blocks_per_step == 1
    other = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    rid = engine.add_request(PROMPT, GREEDY)
    engine.step()  # admitted: it waits for its KV, holding blocks; the load starts
    worker.wait_any(30)  # fetched; now only the runner steps copy it in
    loaded, out = [], {rid: [], other: []}
    while engine.has_unfinished_requests():
        so = engine.schedule()
        if any(new.req_id == rid for new in so.scheduled_new_reqs):
            assert worker.num_loaded_blocks == 4  # all of it in before its first step
        before = worker.num_loaded_blocks
        for delta in engine.process(so, engine.execute(so)):
            out[delta.request_id] += delta.new_token_ids
        loaded.append(worker.num_loaded_blocks - before)
    assert loaded[:4] == [1, 1, 1, 1] and not any(loaded[4:])  # one block a step
    assert out[rid] == colocated
    assert engine.check_idle() and worker.num_staged() == 0
    engine.close()


def test_a_prompt_on_a_block_boundary_computes_only_its_last_token(tiny, cache):
    prompt = PROMPT[:64]  # four full blocks
    (alone,) = engine_for(tiny).generate([prompt], GREEDY)
    first = engine_for(tiny, kv_connector="disk")
    first.generate([prompt], GREEDY)
    first.close()
    engine = engine_for(tiny, kv_connector="disk")
    (done,) = engine.generate([prompt], GREEDY)
    assert done.token_ids == alone.token_ids
    assert done.cached_tokens == 63  # the last block loaded too; one token computed
    assert engine.kv_connector.worker.num_loaded_blocks == 4
    assert engine.check_idle()
    engine.close()
