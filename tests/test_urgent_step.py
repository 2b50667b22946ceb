"""Step composition when an urgent request arrives under load (priority policy).

Live, an urgent prompt used to share its step with the whole batch's decodes and other
prompts' chunks, and took ~1.9x its idle TTFT. The step that admits it now carries only it
and what ranks above it.
"""

from __future__ import annotations

import pytest

from conftest import FakeClock, make_request, make_scheduler, step
from kvcache import KVCacheManager
from scheduling import Scheduler, SchedulerConfig
from scheduling.cost_model import StepCostModel
from scheduling.policies.priority import PriorityPolicy


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


# A 2-core CPU's step costs as the online fit finds them live: a fixed 6.8 ms, ~1 ms a
# decode row, 0.35 ms a prompt token.
CPU = StepCostModel(
    base_s=0.0068, per_prefill_token_s=0.00035, per_decode_token_s=0.00095, per_context_token_s=0
)


def cpu_priority_scheduler(**policy: object) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    kv = KVCacheManager(512, 4, True, "sha256")
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, watermark=0.0)
    return Scheduler(config, kv, PriorityPolicy(prior=CPU, **policy), clock), clock  # type: ignore[arg-type]


def expected_cap(urgent_prompt: int, urgent_wait: float = 0.3) -> int:
    target = urgent_wait * CPU.prefill_time(urgent_prompt)
    per = CPU.per_decode_token_s
    return max(int(CPU.base_s / per), int((target - CPU.base_s) / per))


def decoding_batch(sched: Scheduler) -> list:
    """Sixteen priority-1 requests, past their prompts and decoding."""
    batch = [make_request(16, max_tokens=200, priority=1) for _ in range(16)]
    for req in batch:
        sched.add_request(req)
    step(sched)
    return batch


def test_steps_stay_short_while_urgent_requests_are_about() -> None:
    sched, _ = cpu_priority_scheduler()
    batch = decoding_batch(sched)
    # One class only: no cap, the whole batch decodes each step.
    assert step(sched).total_num_scheduled_tokens == 16
    urgent = make_request(128, max_tokens=40, priority=0)
    sched.add_request(urgent)
    out = step(sched)
    assert out.num_scheduled_tokens == {urgent.request_id: 128}  # alone, uncapped
    cap = expected_cap(128)
    assert 7 <= cap < 16
    seen = {r.request_id: 0 for r in batch}
    for _ in range(30):
        out = step(sched)
        # The urgent decode is never capped, and the step holds at most `cap` tokens.
        assert out.num_scheduled_tokens[urgent.request_id] == 1
        assert out.total_num_scheduled_tokens <= cap
        for rid in out.num_scheduled_tokens:
            if rid in seen:
                seen[rid] += 1
    # Capped work slows but is dealt to everyone: no background request starves.
    assert min(seen.values()) >= 30 * (cap - 1) // 16 - 1


def test_the_cap_lifts_once_urgent_requests_stop_coming() -> None:
    sched, clock = cpu_priority_scheduler(window_s=5.0)
    decoding_batch(sched)
    urgent = make_request(64, max_tokens=2, priority=0)
    sched.add_request(urgent)
    for _ in range(4):
        step(sched)
    assert urgent.request_id not in sched.requests  # finished
    assert step(sched).total_num_scheduled_tokens < 16  # still within the window
    clock.now += 6.0
    assert step(sched).total_num_scheduled_tokens == 16


def test_urgent_wait_zero_turns_the_cap_off() -> None:
    sched, _ = cpu_priority_scheduler(urgent_wait=0.0)
    decoding_batch(sched)
    urgent = make_request(128, max_tokens=40, priority=0)
    sched.add_request(urgent)
    step(sched)
    assert step(sched).total_num_scheduled_tokens == 17


def test_urgent_wait_reaches_the_priority_policy_only() -> None:
    from daemon.engine.config import EngineConfig
    from daemon.engine.setup import make_policy

    policy = make_policy(EngineConfig(policy="priority", urgent_wait=0.5))
    assert isinstance(policy, PriorityPolicy) and policy.urgent_wait == 0.5
    assert make_policy(EngineConfig(policy="priority")).urgent_wait == 0.3  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="urgent_wait: only the priority policy"):
        make_policy(EngineConfig(policy="fcfs", urgent_wait=0.5))
    with pytest.raises(ValueError, match="urgent_wait: must be >= 0"):
        make_policy(EngineConfig(policy="priority", urgent_wait=-1))
