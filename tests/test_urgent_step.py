"""Step composition when an urgent request arrives under load (priority policy).

Live, an urgent prompt used to share its step with the whole batch's decodes and other
prompts' chunks, and took ~1.9x its idle TTFT. The step that admits it now carries only it
and what ranks above it.
"""

from __future__ import annotations

from conftest import make_request, make_scheduler, step


def loaded(policy: str):
    """Four priority-1 requests decoding, one more priority-1 prompt waiting to start."""
    sched = make_scheduler(num_blocks=128, policy=policy, max_num_batched_tokens=256)
    batch = [make_request(16, max_tokens=50, priority=1) for _ in range(4)]
    for req in batch:
        sched.add_request(req)
    step(sched)
    step(sched)
    late = make_request(16, max_tokens=50, priority=1)
    sched.add_request(late)
    return sched, batch, late


def test_urgent_prefill_runs_alone_then_the_batch_resumes() -> None:
    sched, batch, late = loaded("priority")
    urgent = make_request(32, max_tokens=4, priority=0)
    sched.add_request(urgent)
    out = step(sched)
    assert out.num_scheduled_tokens == {urgent.request_id: 32}
    assert (out.shape.num_prefill_tokens, out.shape.num_decode_tokens) == (32, 0)
    # Next step everyone is back: the urgent decode first, the batch, the late prompt.
    out = step(sched)
    assert out.num_scheduled_tokens[urgent.request_id] == 1
    assert all(out.num_scheduled_tokens[r.request_id] == 1 for r in batch)
    assert out.num_scheduled_tokens[late.request_id] == 16


def test_work_ranked_above_the_urgent_prefill_stays_in_its_step() -> None:
    sched, _, _ = loaded("priority")
    first = make_request(8, max_tokens=20, priority=0)
    sched.add_request(first)
    step(sched)  # first's prompt, alone
    second = make_request(8, max_tokens=4, priority=0)
    sched.add_request(second)
    out = step(sched)
    # `first` ranks above `second` (earlier arrival): its decode rides along; the
    # priority-1 batch it jumped does not.
    assert out.num_scheduled_tokens == {first.request_id: 1, second.request_id: 8}


def test_fcfs_step_composition_is_unchanged() -> None:
    sched, _, late = loaded("fcfs")
    newcomer = make_request(32, max_tokens=4, priority=0)
    sched.add_request(newcomer)
    out = step(sched)
    # Nothing jumps under fcfs: the batch decodes, both prompts prefill in one step.
    assert out.shape.num_decode_tokens == 4
    assert out.num_scheduled_tokens[late.request_id] == 16
    assert out.num_scheduled_tokens[newcomer.request_id] == 32
