"""KV events: exact, replayable records of what the prefix cache gains and drops."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import FakeClock, make_request
from kvcache import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    prefix_block_hashes,
    replay,
    request_extra_keys,
)
from plugins import load_policy
from scheduling import QueueFullError, RequestStatus, RunnerOutput, Scheduler, SchedulerConfig
from scheduling.routing import CacheMirror

BLOCK = 4


def recording_scheduler(num_blocks: int, **cfg: object) -> Scheduler:
    cfg.setdefault("watermark", 0.0)
    kv = KVCacheManager(num_blocks, BLOCK, record_events=True)
    return Scheduler(SchedulerConfig(**cfg), kv, load_policy("fcfs"), FakeClock())


def test_recording_is_off_by_default_and_costs_a_plain_pool():
    kv = KVCacheManager(8, BLOCK)
    assert type(kv.pool) is BlockPool
    with pytest.raises(RuntimeError, match="record_events=False"):
        kv.drain_events()


def test_events_name_stored_chains_evictions_and_resets():
    kv = KVCacheManager(4, BLOCK, record_events=True)
    a = make_request(list(range(10, 19)))  # 9 tokens: two full blocks
    kv.allocate_slots(a, 9)
    [stored] = kv.drain_events()
    assert stored == BlockStored(tuple(a.block_hashes[:2]), None)
    assert kv.drain_events() == [], "events are handed out once"
    kv.free(a)
    # A new 16-token prompt needs all 4 blocks: both cached ones are evicted, in one event.
    b = make_request(list(range(100, 116)))
    kv.allocate_slots(b, 16)
    removed, stored_b = kv.drain_events()
    assert removed == BlockRemoved(tuple(a.block_hashes[:2][::-1]))
    assert stored_b == BlockStored(tuple(b.block_hashes), None)
    kv.free(b, trusted=False)
    assert kv.drain_events() == [BlockRemoved(tuple(b.block_hashes))]
    kv.allocate_slots(c := make_request(list(range(200, 208))), 8)
    kv.free(c)
    assert kv.reset_prefix_cache()
    assert kv.drain_events()[-1] == AllBlocksCleared()
    assert kv.cached_block_hashes() == set()


def test_a_hit_extends_the_chain_with_its_parent_named():
    kv = KVCacheManager(16, BLOCK, record_events=True)
    a = make_request(list(range(9)))
    kv.allocate_slots(a, 9)
    b = make_request([*range(8), 50, 51, 52, 53, 54])  # shares a's first two blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.drain_events()
    kv.allocate_slots(b, b.num_tokens - n, hits)
    assert kv.drain_events() == [BlockStored((b.block_hashes[2],), b.block_hashes[1])]


@pytest.mark.parametrize(("salt", "lora_id"), [(None, None), ("tenant-a", None), ("t", "ad:1f")])
@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_prefix_block_hashes_equal_the_managers(salt, lora_id, hash_algo):
    prompt = [(i * 37) % 500 for i in range(23)]
    kv = KVCacheManager(16, BLOCK, hash_algo=hash_algo)
    req = make_request(prompt, cache_salt=salt)
    req.lora_id = lora_id
    kv.allocate_slots(req, len(prompt))
    ours = prefix_block_hashes(prompt, BLOCK, hash_algo, request_extra_keys(salt, lora_id))
    assert ours == req.block_hashes and len(ours) == 5
    assert prefix_block_hashes(prompt, BLOCK, hash_algo) != (ours if salt else [])
    with pytest.raises(TypeError, match="request_extra_keys"):
        prefix_block_hashes(prompt, BLOCK, hash_algo, salt or "x")  # type: ignore[arg-type]


add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 9), st.integers(1, 8))
op = st.one_of(
    add,
    add,
    add,
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("error"), st.integers(0, 40)),  # the step failed: untrusted free
    st.tuples(st.just("reset"), st.just(0)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=8, max_size=40), num_blocks=st.integers(4, 10))
def test_replaying_events_gives_the_cached_set_after_every_step(ops, num_blocks):
    sched = recording_scheduler(num_blocks, max_num_batched_tokens=16, max_num_seqs=3)
    kv = sched.kv
    drained: list = []
    mirror = CacheMirror()
    added = []

    def check() -> None:
        events = kv.drain_events()
        drained.extend(events)
        mirror.apply(0, events)
        kv.check_integrity()
        assert replay(drained) == kv.cached_block_hashes()
        assert mirror.hashes(0) == kv.cached_block_hashes()

    def step() -> None:
        out = sched.schedule()
        sampled = {rid: [7] for rid in out.sampling_req_ids if rid in sched.requests}
        sched.clock.now += 0.01
        sched.update(out, RunnerOutput(sampled))
        check()

    for kind, a, *rest in ops:
        if kind == "add":
            # A few shared bases (prefix hits, partly shared chains) with unique tails.
            k = len(added)
            tail, max_tokens = rest
            prompt = [900 + a] * (2 * a * BLOCK) + [k * 13 + j for j in range(tail + 1)]
            req = make_request(prompt, request_id=f"r{k}", max_tokens=max_tokens)
            try:
                sched.add_request(req)
            except (ValueError, QueueFullError):
                continue
            added.append(req)
        elif kind == "step":
            for _ in range(a):
                step()
        elif kind in ("abort", "error") and added:
            status = RequestStatus.FINISHED_ABORTED
            if kind == "error":
                status = RequestStatus.FINISHED_ERROR
            sched.finish_requests([added[a % len(added)].request_id], status)
            check()
        elif kind == "reset":
            kv.reset_prefix_cache()
            check()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests()
    event(f"evictions: {kv.pool.num_evictions > 0}")
    event(f"removals: {any(isinstance(e, BlockRemoved) for e in drained)}")
    event(f"hits: {kv.prefix_stats.hits > 0}")
