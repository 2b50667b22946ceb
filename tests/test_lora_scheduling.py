"""LoRA in the torch-free core: the adapter id keys the prefix cache, and no more distinct
adapters run than --max-loras slots."""

from __future__ import annotations

from conftest import make_request, make_scheduler, run_to_completion, step
from kvcache.block_hash import get_hash_fn, hash_request_blocks

PREFIX = list(range(100, 112))  # three blocks of 4


def _with_adapter(lora_id: str | None, prompt: list[int], **kw):
    req = make_request(prompt, **kw)
    req.lora_id = lora_id
    req.lora = lora_id  # opaque to the scheduler; the runner gets it back as sent
    return req


def test_block_hashes_differ_per_adapter_and_keep_the_salt() -> None:
    fn = get_hash_fn("sha256")
    tokens = list(range(12))
    hashes = {}
    for key in [(None, None), (None, "a:1"), (None, "b:1"), ("salt", None), ("salt", "a:1")]:
        known: list = []
        hash_request_blocks(fn, 4, tokens, known, *key)
        hashes[key] = known
    firsts = {key: h[0] for key, h in hashes.items()}
    assert len(set(firsts.values())) == len(firsts)  # every pair of keys differs
    # The chain carries the key: later blocks differ too.
    assert hashes[None, "a:1"][2] != hashes[None, None][2]
    again: list = []
    hash_request_blocks(fn, 4, tokens, again, None, "a:1")
    assert again == hashes[None, "a:1"]


def test_prefix_cache_hits_only_within_one_adapter() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(_with_adapter("a:1", [*PREFIX, 1], max_tokens=1))
    list(run_to_completion(sched))
    for lora_id, hit in [(None, 0), ("b:1", 0), ("a:2", 0), ("a:1", 12)]:
        req = _with_adapter(lora_id, [*PREFIX, 1], max_tokens=1)
        sched.add_request(req)
        step(sched)
        assert req.num_cached_tokens == hit, lora_id
        list(run_to_completion(sched))


def test_new_requests_carry_their_adapter_to_the_runner() -> None:
    sched = make_scheduler()
    sched.add_request(_with_adapter("a:1", [1, 2, 3]))
    (new,) = sched.schedule().scheduled_new_reqs
    assert new.lora == "a:1"


def test_max_loras_holds_back_a_third_adapter_but_not_the_base() -> None:
    sched = make_scheduler(max_loras=2)
    a, b = _with_adapter("a", [1, 2], max_tokens=3), _with_adapter("b", [3, 4], max_tokens=3)
    c = _with_adapter("c", [5, 6], max_tokens=3)
    plain, more_a = _with_adapter(None, [7, 8], max_tokens=3), _with_adapter("a", [9], max_tokens=3)
    for req in (a, b, c, plain, more_a):
        sched.add_request(req)
    out = step(sched)
    # c waits for a slot; the base request and a second "a" request behind it get in.
    assert set(out.num_scheduled_tokens) == {r.request_id for r in (a, b, plain, more_a)}
    while a.request_id in sched.requests or b.request_id in sched.requests:
        out = step(sched)
        running = {r.lora_id for r in sched.running if r.lora_id}
        assert len(running) <= 2
    list(run_to_completion(sched))
    assert c.num_output_tokens == 3  # admitted once a slot was free
