import pytest

from conftest import (
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    sample_all,
    step,
)
from scheduling import (
    DEFER,
    BasePolicy,
    QueueFullError,
    RequestStatus,
    RunnerOutput,
    SamplingParams,
    SamplingParamsError,
    reject,
)


def test_budget_and_max_num_seqs_hold_every_step():
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=20, max_num_seqs=3)
    for req in make_requests(8, prompt_len=13, max_tokens=5):
        sched.add_request(req)
    steps = list(run_to_completion(sched))
    assert all(o.total_num_scheduled_tokens <= 20 for o in steps)
    assert all(len(o.num_scheduled_tokens) <= 3 for o in steps)
    assert max(o.total_num_scheduled_tokens for o in steps) == 20
    assert sched.kv.num_free_blocks == 256


def test_chunked_prefill_spreads_long_prompt_while_decodes_continue():
    sched = make_scheduler(
        num_blocks=128, block_size=16, max_num_batched_tokens=256, long_prefill_token_threshold=64
    )
    decoders = make_requests(3, prompt_len=5, max_tokens=40)
    for req in decoders:
        sched.add_request(req)
    step(sched)  # prefill the short ones; they are decoding from now on
    long = make_request(1000, max_tokens=2)
    sched.add_request(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        before = [r.num_output_tokens for r in decoders]
        out = step(sched)
        assert out.num_scheduled_tokens[long.request_id] <= 64
        assert [r.num_output_tokens for r in decoders] == [b + 1 for b in before]
        prefill_steps += 1
    assert prefill_steps >= 16
    list(run_to_completion(sched))


def test_chunked_prefill_off_requires_whole_prompt():
    sched = make_scheduler(
        num_blocks=64, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    a, b = make_request(40, max_tokens=2), make_request(40, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 40}
    sched.update(out, sample_all(sched, out))
    list(run_to_completion(sched))


def grow_until_preemption(policy: str, priorities: list[int]):
    # 3 requests of 8-token prompts; 8 blocks of 4 tokens hold 32 tokens: they cannot all
    # reach 8 + 8 tokens, so someone must be evicted.
    sched = make_scheduler(num_blocks=8, block_size=4, policy=policy)
    reqs = [make_request(8, max_tokens=8, priority=p) for p in priorities]
    for req in reqs:
        sched.add_request(req)
    while sched.num_preemptions == 0:
        step(sched)
    return sched, reqs


def test_fcfs_preempts_the_newest_and_it_completes():
    sched, reqs = grow_until_preemption("fcfs", [0, 0, 0])
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    assert reqs[2].status == RequestStatus.PREEMPTED
    assert reqs[2].num_computed_tokens == 0
    assert not sched.kv.get_block_ids(reqs[2].request_id)
    list(run_to_completion(sched))
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert sched.kv.num_free_blocks == 8


def test_priority_preempts_the_lowest_priority_even_if_older():
    sched, reqs = grow_until_preemption("priority", [5, 0, 1])
    assert [r.num_preemptions for r in reqs] == [1, 0, 0]
    list(run_to_completion(sched))
    assert all(r.num_output_tokens == 8 for r in reqs)


def test_preempted_request_comes_back_as_new_with_its_outputs():
    sched, reqs = grow_until_preemption("fcfs", [0, 0, 0])
    victim = reqs[2]
    outputs_before = list(victim.output_token_ids)
    assert outputs_before  # it had generated before being evicted
    for _ in range(50):
        out = step(sched)
        resumed = [n for n in out.scheduled_new_reqs if n.req_id == victim.request_id]
        if resumed:
            assert resumed[0].token_ids[-len(outputs_before) :] == outputs_before
            break
    else:
        pytest.fail("victim never resumed")
    list(run_to_completion(sched))


def test_urgent_waiting_request_preempts_running_low_priority():
    sched = make_scheduler(num_blocks=64, policy="priority", max_num_seqs=2)
    batch = [make_request(8, max_tokens=50, priority=1) for _ in range(2)]
    for req in batch:
        sched.add_request(req)
    step(sched)
    urgent = make_request(8, max_tokens=2, priority=0)
    sched.add_request(urgent)
    out = step(sched)
    assert urgent.request_id in out.num_scheduled_tokens
    assert batch[1].status == RequestStatus.PREEMPTED  # the newer of the two equals
    assert batch[0].status == RequestStatus.RUNNING
    list(run_to_completion(sched))
    assert all(r.num_output_tokens == 50 for r in batch)


def test_fcfs_does_not_let_newcomers_preempt():
    sched = make_scheduler(num_blocks=64, policy="fcfs", max_num_seqs=2)
    for req in make_requests(2, max_tokens=5):
        sched.add_request(req)
    step(sched)
    late = make_request(8, max_tokens=2, priority=-10)
    sched.add_request(late)
    out = step(sched)
    assert late.request_id not in out.num_scheduled_tokens
    assert sched.num_preemptions == 0
    list(run_to_completion(sched))


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_any_state_frees_blocks(when):
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    reqs = [make_request(8, max_tokens=8) for _ in range(3)]
    for req in reqs:
        sched.add_request(req)
    target = reqs[0]
    if when == "prefilling":
        step(sched)
        assert 0 < target.num_computed_tokens < 8
    elif when == "decoding":
        while target.num_output_tokens == 0:
            step(sched)
    elif when == "preempted":
        sched, reqs = grow_until_preemption("fcfs", [0, 0, 0])
        target = reqs[2]
        assert target.status == RequestStatus.PREEMPTED
    sched.finish_requests([target.request_id], RequestStatus.FINISHED_ABORTED)
    assert target.status == RequestStatus.FINISHED_ABORTED
    assert not sched.kv.get_block_ids(target.request_id)
    sched.check_integrity()
    out = sched.schedule()
    assert target.request_id in out.finished_req_ids
    assert target.request_id not in out.num_scheduled_tokens
    sched.update(out, sample_all(sched, out))
    list(run_to_completion(sched))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # An id that is unknown or already finished is ignored.
    sched.finish_requests([target.request_id, "nope"], RequestStatus.FINISHED_ABORTED)


def test_add_request_errors_name_the_problem():
    sched = make_scheduler(num_blocks=8, block_size=4, max_waiting=1)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        sched.add_request(make_request(32))
    first = make_request(4)
    sched.add_request(first)
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(first)
    with pytest.raises(QueueFullError):
        sched.add_request(make_request(4))
    with pytest.raises(ValueError, match="prompt"):
        make_request([])


def test_watermark_holds_back_admission_but_not_a_lone_request():
    sched = make_scheduler(num_blocks=10, block_size=4, watermark=0.2)  # keep 2 blocks free
    a = make_request(32, max_tokens=3)  # all 8 free-able blocks: admitted since it is alone
    sched.add_request(a)
    step(sched)
    assert a.status == RequestStatus.RUNNING
    b = make_request(4, max_tokens=1)  # 1 block would leave 1 free < watermark
    sched.add_request(b)
    out = step(sched)
    assert b.request_id not in out.num_scheduled_tokens
    list(run_to_completion(sched))
    assert b.status == RequestStatus.FINISHED_LENGTH


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request(4, max_tokens=10, ignore_eos=False)
    min_tok = make_request(4, max_tokens=10, ignore_eos=False, min_tokens=3)
    stop_id = make_request(4, max_tokens=10, stop_token_ids=[9])
    for req in (eos, min_tok, stop_id):
        sched.add_request(req)
    for token in (2, 2, 2):
        out = sched.schedule()
        ro = sample_all(sched, out, token)
        if stop_id.request_id in ro.sampled_token_ids:
            ro.sampled_token_ids[stop_id.request_id] = [9]
        sched.update(out, ro)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.num_output_tokens == 1
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 9
    assert min_tok.status == RequestStatus.FINISHED_STOPPED and min_tok.num_output_tokens == 3


def test_max_model_len_ends_a_request_with_length():
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=12)
    req = make_request(8, max_tokens=100)
    sched.add_request(req)
    list(run_to_completion(sched))
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 12


def test_speculative_tokens_roll_back_when_rejected():
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = make_request(6, max_tokens=20)
    sched.add_request(req)
    step(sched)
    assert req.num_computed_tokens == 6 and req.num_tokens == 7
    req.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    assert out.num_scheduled_tokens[req.request_id] == 4
    assert out.scheduled_spec_decode_tokens[req.request_id] == [11, 12, 13]
    assert req.num_computed_tokens == 10
    outputs = sched.update(out, RunnerOutput({req.request_id: [11, 40]}))  # 1 accepted + bonus
    assert outputs[0].new_token_ids == [11, 40]
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert req.spec_token_ids == []
    sched.check_integrity()
    list(run_to_completion(sched))


class _RejectOddDeferOnce(BasePolicy):
    """Rejects odd ids; makes every other request wait one step before it is admitted."""

    name = "reject-odd"

    def __init__(self):
        self.asked = set()

    def rank(self, req, now):
        return req.arrival_time

    def admit(self, req, load, now):
        if int(req.request_id.split("-")[1]) % 2:
            return reject("odd ids are not welcome")
        first_time = req.request_id not in self.asked
        self.asked.add(req.request_id)
        return DEFER if first_time else super().admit(req, load, now)


def test_policy_reject_and_defer():
    from conftest import FakeClock
    from kvcache import KVCacheManager
    from scheduling import Scheduler, SchedulerConfig

    policy = _RejectOddDeferOnce()
    sched = Scheduler(SchedulerConfig(), KVCacheManager(64, 4), policy, FakeClock())
    reqs = make_requests(4, max_tokens=3)
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    rejected = [r for r in reqs if r.status == RequestStatus.FINISHED_REJECTED]
    assert len(rejected) == 2 and all(r.stop_reason == "odd ids are not welcome" for r in rejected)
    assert out.is_empty  # the even ones were deferred
    assert all(r.status == RequestStatus.WAITING for r in reqs if r not in rejected)
    outputs = sched.update(out, sample_all(sched, out))
    assert sorted(o.request_id for o in outputs if o.finish_reason == "rejected") == sorted(
        r.request_id for r in rejected
    )
    list(run_to_completion(sched))
    assert all(r.is_finished for r in reqs)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -1}),
        ("top_p", {"top_p": 0}),
        ("top_k", {"top_k": -5}),
        ("min_p", {"min_p": 2}),
        ("presence_penalty", {"presence_penalty": 3}),
        ("frequency_penalty", {"frequency_penalty": -3}),
        ("repetition_penalty", {"repetition_penalty": 0}),
        ("logprobs", {"logprobs": 50}),
        ("logit_bias", {"logit_bias": {5: 500}}),
        ("min_tokens", {"min_tokens": 20, "max_tokens": 5}),
        ("stop", {"stop": [""]}),
    ],
)
def test_sampling_params_errors_name_the_field(field, kwargs):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(stop="END", logit_bias={"3": 1})
    assert p.stop == ["END"] and p.logit_bias == {3: 1.0}
    assert SamplingParams(temperature=0).greedy
