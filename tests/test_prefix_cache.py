from conftest import make_request, make_scheduler, run_to_completion, sample_all, step
from kvcache import KVCacheManager

PREFIX = list(range(100, 112))  # three blocks of 4


def test_same_three_block_prefix_gets_three_cached_blocks():
    sched = make_scheduler(num_blocks=32, block_size=4)
    a = make_request([*PREFIX, 1, 2], max_tokens=2)
    sched.add_request(a)
    list(run_to_completion(sched))
    b = make_request([*PREFIX, 3, 4, 5], max_tokens=2)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 12
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 12
    assert out.num_scheduled_tokens[b.request_id] == 3
    assert new.block_ids[:3] == sched.kv.get_block_ids(b.request_id)[:3]
    assert sched.kv.prefix_stats.hits == 12
    sched.update(out, sample_all(sched, out))
    list(run_to_completion(sched))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_concurrent_requests_share_blocks_with_ref_counts():
    sched = make_scheduler(num_blocks=32, block_size=4)
    a = make_request([*PREFIX, 1], max_tokens=3)
    sched.add_request(a)
    step(sched)
    b = make_request([*PREFIX, 2], max_tokens=3)
    sched.add_request(b)
    step(sched)
    shared = sched.kv.req_to_blocks[a.request_id][:3]
    assert shared == sched.kv.req_to_blocks[b.request_id][:3]
    assert all(blk.ref_cnt == 2 for blk in shared)
    list(run_to_completion(sched))
    assert sched.kv.num_free_blocks == 32


def test_different_cache_salt_gets_no_hit():
    sched = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(make_request([*PREFIX, 1], max_tokens=1, cache_salt="alice"))
    list(run_to_completion(sched))
    other = make_request([*PREFIX, 1], max_tokens=1, cache_salt="bob")
    sched.add_request(other)
    step(sched)
    assert other.num_cached_tokens == 0
    same = make_request([*PREFIX, 1], max_tokens=1, cache_salt="alice")
    sched.add_request(same)
    step(sched)
    assert same.num_cached_tokens == 12
    list(run_to_completion(sched))


def test_evicted_block_is_no_longer_a_hit():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request([*PREFIX, 1], max_tokens=1))
    list(run_to_completion(sched))
    # Fill the whole pool with unrelated prompts: every cached block gets reused.
    sched.add_request(make_request(list(range(500, 531)), max_tokens=1))
    list(run_to_completion(sched))
    assert sched.kv.pool.num_evictions >= 3
    again = make_request([*PREFIX, 1], max_tokens=1)
    sched.add_request(again)
    step(sched)
    assert again.num_cached_tokens == 0
    list(run_to_completion(sched))


def test_last_token_is_always_computed():
    kv = KVCacheManager(16, 4)
    a = make_request(list(PREFIX), max_tokens=1)
    kv.allocate_slots(a, 12)
    kv.free(a)
    b = make_request(list(PREFIX), max_tokens=1)
    blocks, num_tokens = kv.get_computed_blocks(b)
    assert len(blocks) == 2 and num_tokens == 8  # not 12: the last token needs logits
    kv.check_integrity()


def test_allocate_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(4, 4)
    a = make_request(12, max_tokens=1)
    assert kv.allocate_slots(a, 12) is not None
    b = make_request(8, max_tokens=1)
    before = (kv.num_free_blocks, dict(kv.req_to_blocks))
    assert kv.allocate_slots(b, 8) is None
    assert (kv.num_free_blocks, dict(kv.req_to_blocks)) == before
    assert kv.allocate_slots(b, 4) is not None
    assert kv.allocate_slots(b, 4, reserve_blocks=1) is None  # the watermark must stay free
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.usage() == 0.0


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=False)
    for _ in range(2):
        req = make_request([*PREFIX, 1], max_tokens=1)
        sched.add_request(req)
        list(run_to_completion(sched))
        assert req.num_cached_tokens == 0


def test_a_failed_step_leaves_no_cache_hits_behind():
    from scheduling import RequestStatus

    sched = make_scheduler(num_blocks=32, block_size=4)
    a = make_request([*PREFIX, 1], max_tokens=3)
    sched.add_request(a)
    sched.schedule()  # its blocks are registered now, but the step "fails"
    sched.finish_requests([a.request_id], RequestStatus.FINISHED_ERROR)
    sched.check_integrity()
    b = make_request([*PREFIX, 1], max_tokens=1)
    sched.add_request(b)
    step(sched)
    assert b.num_cached_tokens == 0
    list(run_to_completion(sched))
