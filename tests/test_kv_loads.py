"""Scheduler side of KV connectors, torch-free: WAITING_FOR_KV holds blocks, others go on."""

from __future__ import annotations

from conftest import FakeClock, make_request, run_to_completion, sample_all, step
from kvcache import KVCacheManager
from kvcache.connectors import KVLayout, MemoryStore, StoreLookup
from plugins import load_policy
from scheduling import RequestStatus, Scheduler, SchedulerConfig

BS = 4
LAYOUT = KVLayout("test-model", "float32", BS, 1, 1, 1)
PROMPT = list(range(100, 117))  # 17 tokens: four full blocks, then one token


def make(num_blocks: int = 32, saves: bool = True, **cfg: object):
    store = MemoryStore(LAYOUT, 8, 1 << 20)
    lookup = StoreLookup(LAYOUT, store, saves=saves)
    cfg.setdefault("watermark", 0.0)
    kv = KVCacheManager(num_blocks, BS)
    sched = Scheduler(SchedulerConfig(**cfg), kv, load_policy("fcfs"), FakeClock(), lookup)
    return sched, store


def fill(store: MemoryStore, req, num_blocks: int) -> None:
    """Put the first blocks of `req`'s prompt in the store (as another engine had saved)."""
    sched, _ = make()
    sched.kv._update_hashes(req)
    for h in req.block_hashes[:num_blocks]:
        store.put(LAYOUT.block_key(h), b"x" * 8)


def test_a_stored_prompt_waits_for_kv_holding_blocks_while_others_run():
    sched, store = make()
    loaded = make_request(list(PROMPT), max_tokens=2)
    fill(store, loaded, 4)
    other = make_request(6, max_tokens=3)
    sched.add_request(loaded)
    sched.add_request(other)
    out = sched.schedule()
    assert loaded.status is RequestStatus.WAITING_FOR_KV
    assert len(sched.kv.get_block_ids(loaded.request_id)) == 4
    assert loaded.request_id not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {other.request_id: 6}
    (spec,) = out.kv_connector_meta.loads
    assert (spec.req_id, spec.first_block, len(spec.keys)) == (loaded.request_id, 0, 4)
    sched.update(out, sample_all(sched, out))
    sched.check_integrity()
    for _ in range(2):  # the load has not landed: it stays out of every step
        assert loaded.request_id not in step(sched).num_scheduled_tokens
    assert sched.kv_loads_landed({loaded.request_id: 4}) == [loaded.request_id]
    out = sched.schedule()
    (new,) = [n for n in out.scheduled_new_reqs if n.req_id == loaded.request_id]
    assert new.num_computed_tokens == 16 and out.num_scheduled_tokens[loaded.request_id] == 1
    assert loaded.num_cached_tokens == 16
    sched.update(out, sample_all(sched, out))
    list(run_to_completion(sched))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_partial_load_computes_the_rest_and_a_failed_one_all_of_it():
    for landed, computed in ((2, 8), (0, 0)):
        sched, store = make()
        req = make_request(list(PROMPT), max_tokens=1)
        fill(store, req, 4)
        sched.add_request(req)
        step(sched)
        sched.kv_loads_landed({req.request_id: landed})
        out = sched.schedule()
        assert out.scheduled_new_reqs[0].num_computed_tokens == computed
        assert out.num_scheduled_tokens[req.request_id] == 17 - computed
        sched.update(out, sample_all(sched, out))
        list(run_to_completion(sched))
        assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_local_hit_first_then_the_store_supplies_what_follows():
    sched, store = make()
    first = make_request([*PROMPT[:8], 1], max_tokens=1)
    sched.add_request(first)
    list(run_to_completion(sched))  # two blocks now in the local prefix cache
    req = make_request(list(PROMPT), max_tokens=1)
    fill(store, req, 4)
    sched.add_request(req)
    out = sched.schedule()
    (spec,) = out.kv_connector_meta.loads
    assert spec.first_block == 2 and len(spec.keys) == 2
    assert req.num_computed_tokens == 8
    sched.update(out, sample_all(sched, out))
    sched.kv_loads_landed({req.request_id: 2})
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    sched.update(out, sample_all(sched, out))
    list(run_to_completion(sched))
    sched.check_integrity()


def test_abort_while_loading_frees_its_blocks_and_a_late_landing_is_refused():
    sched, store = make()
    req = make_request(list(PROMPT), max_tokens=1)
    fill(store, req, 4)
    sched.add_request(req)
    step(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 4
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv_loads_landed({req.request_id: 4}) == []
    out = sched.schedule()
    assert req.request_id in out.finished_req_ids
    sched.check_integrity()


def test_computed_prompt_blocks_are_saved_once_each_chunk_fills_them():
    sched, _ = make(max_num_batched_tokens=6)
    req = make_request(list(PROMPT), max_tokens=1)
    sched.add_request(req)
    saved: list[tuple[int, int]] = []
    for out in run_to_completion(sched):
        for spec in out.kv_connector_meta.saves:
            saved.append((spec.first_block, len(spec.keys)))
    # chunks of 6 tokens: 0-6 fills block 0, 6-12 block 1 and 2, 12-17 block 3
    assert saved == [(0, 1), (1, 2), (3, 1)]


def test_a_consumer_saves_nothing_and_a_full_pool_makes_the_load_wait():
    sched, store = make(num_blocks=5, saves=False)
    busy = make_request(16, max_tokens=4)
    sched.add_request(busy)
    step(sched)  # busy holds 4 of 5 blocks
    req = make_request(list(PROMPT), max_tokens=1)
    fill(store, req, 4)
    sched.add_request(req)
    out = step(sched)
    assert req.status is RequestStatus.WAITING and not sched.kv.get_block_ids(req.request_id)
    assert not out.kv_connector_meta.loads and not out.kv_connector_meta.saves
    for _ in range(20):  # the runner side lands each load one step after it starts
        sched.kv_loads_landed({rid: 4 for rid in sched.kv_loads.loading})
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert req.num_cached_tokens == 16  # once busy left, the load ran
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_prompt_ending_on_a_block_boundary_loads_its_last_block_and_computes_one_token():
    sched, store = make()
    req = make_request(list(PROMPT[:16]), max_tokens=1)  # exactly four full blocks
    fill(store, req, 4)
    sched.add_request(req)
    out = sched.schedule()
    (spec,) = out.kv_connector_meta.loads
    # all four blocks, the last one's final token excepted: the step needs its logits
    assert (spec.first_block, len(spec.keys)) == (0, 4)
    assert list(spec.block_ids) == sched.kv.get_block_ids(req.request_id)
    sched.update(out, sample_all(sched, out))
    sched.kv_loads_landed({req.request_id: 4})
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 15
    assert out.num_scheduled_tokens[req.request_id] == 1
    assert sched.kv_loads.num_loaded_tokens == 15
    sched.update(out, sample_all(sched, out))
    list(run_to_completion(sched))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()
