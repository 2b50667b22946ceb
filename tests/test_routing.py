"""Routers against a fake replica set: no model, real KV managers where caches matter."""

import sys
from pathlib import Path

import pytest

from conftest import make_request
from kvcache import KVCacheManager, prefix_block_hashes
from plugins import ROUTER_GROUP, PluginError, UnknownPluginError, load_router, router_names
from scheduling.routing import (
    CacheAwareRouter,
    CacheMirror,
    NoHealthyReplicaError,
    ReplicaLoad,
    Router,
    RouterContext,
    RouteRequest,
)

BLOCK = 4
EXAMPLE = Path(__file__).resolve().parents[1] / "plugins" / "examples" / "least_kv"


class FakeReplica:
    """One replica: a real recording KVCacheManager and the load the router would see."""

    def __init__(self, index: int, num_blocks: int = 64) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK, record_events=True)
        self.load = ReplicaLoad(index, healthy=True)

    def serve(self, prompt: list[int], salt: str | None = None, free: bool = True) -> int:
        """Prefill `prompt` as the engine would; return the tokens served from the cache."""
        req = make_request(prompt, cache_salt=salt)
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert self.kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
        if free:
            self.kv.free(req)
        return num_hit


def route(prompt: list[int], salt: str | None = None) -> RouteRequest:
    extra = (salt,) if salt else ()
    return RouteRequest(prompt, prefix_block_hashes(prompt, BLOCK, extra_keys=extra))


def loads(n: int, **by_index: tuple[int, int]) -> list[ReplicaLoad]:
    out = [ReplicaLoad(i, healthy=True) for i in range(n)]
    for key, (waiting, running) in by_index.items():
        out[int(key[1:])].waiting, out[int(key[1:])].running = waiting, running
    return out


def prompt_with(prefix: int, n_blocks: int, tail: int = 3) -> list[int]:
    return [prefix * 1000 + i for i in range(n_blocks * BLOCK)] + [7] * tail


def test_builtins_are_registered_and_unknown_names_list_them():
    assert {"round_robin", "least_load", "cache_aware"} <= set(router_names())
    for name in ("round_robin", "least_load", "cache_aware"):
        router = load_router(name)
        assert isinstance(router, Router) and router.name == name
    assert load_router("cache_aware", RouterContext(overload_margin=3)).overload_margin == 3
    # Every router, built-in or plugin, is built with the same one RouterContext.
    context = RouterContext(num_replicas=3, block_size=8, hash_algo="sha256")
    for name in ("round_robin", "least_load", "cache_aware"):
        assert load_router(name, context).context is context
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        RouterContext(block_size=0)
    with pytest.raises(UnknownPluginError, match=r"installed: .*cache_aware.*least_load"):
        load_router("nearest")


def test_a_router_built_for_another_api_version_is_refused(monkeypatch):
    from plugins import registry

    class Old(CacheAwareRouter):
        api_version = 0

    class FakeEntryPoint:
        value = "old_pkg:Old"

        def load(self):
            return Old

    monkeypatch.setattr(registry, "installed", lambda group: {"old": FakeEntryPoint()})
    with pytest.raises(PluginError, match=r"version 0.*supports version 2"):
        load_router("old")


def test_round_robin_cycles_and_skips_unhealthy_replicas():
    router = load_router("round_robin")
    replicas = loads(3)
    assert [router.pick(route([1]), replicas).index for _ in range(4)] == [0, 1, 2, 0]
    replicas[1].healthy = False
    picks = [router.pick(route([1]), replicas) for _ in range(4)]
    assert [d.index for d in picks] == [2, 0, 2, 0]
    assert {d.reason for d in picks} == {"round_robin"}
    for r in replicas:
        r.healthy = False
    with pytest.raises(NoHealthyReplicaError):
        router.pick(route([1]), replicas)


def test_least_load_follows_four_waiting_plus_running():
    router = load_router("least_load")
    # Scores: 4*1+0 = 4, 4*0+5 = 5, 4*0+3 = 3.
    replicas = loads(3, r0=(1, 0), r1=(0, 5), r2=(0, 3))
    decision = router.pick(route([1]), replicas)
    assert (decision.index, decision.reason) == (2, "least_load")
    # The routed request counts as waiting there until the next refresh: 3 -> 7.
    assert replicas[2].waiting == 1
    assert router.pick(route([1]), replicas).index == 0
    replicas[0].healthy = False
    assert router.pick(route([1]), replicas).index == 1


def test_cache_aware_sends_a_shared_prefix_to_its_holder():
    replicas = [FakeReplica(i) for i in range(3)]
    router = load_router("cache_aware", RouterContext(block_size=BLOCK))
    first = prompt_with(1, 4)
    d = router.pick(route(first), [r.load for r in replicas])
    assert d.reason == "no_hit" and d.predicted_cached_tokens == 0
    holder = replicas[d.index]
    holder.serve(first)
    router.on_kv_events(d.index, holder.kv.drain_events())
    for r in replicas:
        r.load.waiting = 0
    # Another user over the same system prompt: the holder is picked, even though it is
    # not the least loaded, and the prediction is what its cache really serves.
    holder.load.running = 3
    second = prompt_with(1, 4, tail=9)
    d2 = router.pick(route(second), [r.load for r in replicas])
    assert (d2.index, d2.reason) == (d.index, "cache_hit")
    assert d2.predicted_cached_tokens == 16 == holder.serve(second)
    # A different salt is a different chain: no hit anywhere.
    assert router.pick(route(second, salt="t"), [r.load for r in replicas]).reason == "no_hit"


def test_cache_aware_falls_back_when_the_holder_is_overloaded_and_forgets_a_reset():
    replicas = [FakeReplica(i) for i in range(2)]
    router = CacheAwareRouter(RouterContext(overload_margin=8, block_size=BLOCK))
    prompt = prompt_with(2, 3)
    replicas[0].serve(prompt)
    router.on_kv_events(0, replicas[0].kv.drain_events())
    replicas[0].load.waiting, replicas[0].load.running = 2, 0  # score 8: not over the margin
    assert router.pick(route(prompt), [r.load for r in replicas]).reason == "cache_hit"
    replicas[0].load.waiting, replicas[0].load.running = 2, 1  # score 9 - 0 > 8
    d = router.pick(route(prompt), [r.load for r in replicas])
    assert (d.index, d.reason, d.predicted_cached_tokens) == (1, "overloaded_holder", 0)
    replicas[0].load.waiting = replicas[1].load.waiting = 0
    router.on_replica_reset(0)
    assert router.mirror.hashes(0) == set()
    assert router.pick(route(prompt), [r.load for r in replicas]).reason == "no_hit"


def test_cache_aware_prefers_the_longest_prefix_then_the_lighter_load():
    replicas = [FakeReplica(i) for i in range(3)]
    router = CacheAwareRouter(RouterContext(block_size=BLOCK))
    long_prompt = prompt_with(3, 6)
    replicas[0].serve(long_prompt[: 2 * BLOCK + 1])
    replicas[1].serve(long_prompt[: 5 * BLOCK + 1])
    replicas[2].serve(long_prompt[: 5 * BLOCK + 1])
    for r in replicas:
        router.on_kv_events(r.load.index, r.kv.drain_events())
    replicas[1].load.running = 2
    d = router.pick(route(long_prompt), [r.load for r in replicas])
    assert (d.index, d.reason, d.predicted_cached_tokens) == (2, "cache_hit", 5 * BLOCK)
    # An exact multiple of the block size can hit all but its last block (the manager always
    # computes the last token).
    exact = long_prompt[: 5 * BLOCK]
    assert router.pick(route(exact), [r.load for r in replicas]).predicted_cached_tokens == 16


def test_cache_aware_refuses_the_process_seeded_hash(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match=r"builtin.*PYTHONHASHSEED"):
        load_router("cache_aware", RouterContext(hash_algo="builtin"))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert load_router("cache_aware", RouterContext(hash_algo="builtin")).name == "cache_aware"


def test_mirror_equals_each_replicas_cache_under_forced_evictions():
    # Tiny pools: every new prompt evicts; some steps fail (untrusted free); one resets.
    replicas = [FakeReplica(i, num_blocks=6) for i in range(2)]
    router = CacheAwareRouter(RouterContext(block_size=BLOCK))
    mirror: CacheMirror = router.mirror
    for k in range(40):
        prompt = prompt_with(k % 5, 1 + k % 4, tail=k % 3)
        d = router.pick(route(prompt), [r.load for r in replicas])
        replica = replicas[d.index]
        served = replica.serve(prompt, free=k % 7 != 3)
        assert served == d.predicted_cached_tokens, "the mirror predicted a different hit"
        if k % 7 == 3:
            [req_id] = replica.kv.req_to_blocks
            replica.kv.free(make_request([1], request_id=req_id), trusted=False)
        if k == 20:
            assert replica.kv.reset_prefix_cache()
        router.on_kv_events(d.index, replica.kv.drain_events())
        replica.load.waiting = 0
        for r in replicas:
            assert mirror.hashes(r.load.index) == r.kv.cached_block_hashes()
    assert sum(r.kv.pool.num_evictions for r in replicas) > 10


def test_a_miss_goes_where_the_cache_has_most_room_unless_that_is_too_busy():
    replicas = [FakeReplica(i) for i in range(3)]
    router = CacheAwareRouter(RouterContext(overload_margin=4, block_size=BLOCK))
    replicas[0].serve(prompt_with(5, 6))
    replicas[2].serve(prompt_with(6, 2))
    for r in replicas:
        router.on_kv_events(r.load.index, r.kv.drain_events())
    new = prompt_with(7, 4)
    replicas[1].load.running = 4  # within the margin of the least loaded (score 0)
    d = router.pick(route(new), [r.load for r in replicas])
    assert (d.index, d.reason) == (1, "no_hit")
    replicas[1].load.waiting = 0
    replicas[1].load.running = 5  # past it: the emptier of the other two
    d = router.pick(route(new), [r.load for r in replicas])
    assert (d.index, d.reason) == (2, "no_hit")


def test_the_example_third_party_router_is_discovered_once_installed(tmp_path, monkeypatch):
    assert "least_kv" not in router_names()
    monkeypatch.syspath_prepend(str(EXAMPLE))
    # What pip would leave behind: a dist-info folder with entry_points.txt, on sys.path.
    info = tmp_path / "headrace_least_kv-0.1.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: headrace_least_kv\n")
    info.joinpath("entry_points.txt").write_text(
        f"[{ROUTER_GROUP}]\nleast_kv = headrace_least_kv:LeastKVRouter\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    context = RouterContext(num_replicas=3, block_size=8)
    router = load_router("least_kv", context)
    assert router.context is context  # a plugin is built as the built-ins are
    replicas = loads(3)
    replicas[0].kv_usage, replicas[1].kv_usage, replicas[2].kv_usage = 0.5, 0.2, 0.9
    assert router.pick(route([1]), replicas).index == 1
    replicas[1].healthy = False
    assert router.pick(route([1]), replicas).index == 0
    monkeypatch.delitem(sys.modules, "headrace_least_kv", raising=False)
