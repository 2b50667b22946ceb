"""Random workloads against a tiny block pool: the scheduler's invariants must always hold."""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import make_request, make_scheduler
from scheduling import SLO, QueueFullError, RequestStatus, RunnerOutput

EOS = 2

add = st.tuples(
    st.just("add"),
    st.integers(1, 20),  # prompt length
    st.integers(1, 16),  # max_tokens
    st.integers(0, 2),  # priority
    st.booleans(),  # shares a prefix with others
    st.integers(1, 4),  # how many such requests arrive together
    st.sampled_from([None, 5.0, 1000.0]),  # TTFT SLO in ms (the slo policy sheds tight ones)
)
ops = st.lists(
    st.one_of(
        add,
        add,
        st.tuples(st.just("step"), st.integers(0, 3)),  # drafts for one running request
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(6, 16),
    block_size=st.sampled_from([2, 4, 4]),
    budget=st.integers(4, 32),
    max_num_seqs=st.integers(1, 6),
    threshold=st.integers(0, 8),
    policy=st.sampled_from(["fcfs", "priority", "slo"]),
    watermark=st.sampled_from([0.0, 0.1]),
    overlap=st.booleans(),
    seed=st.randoms(use_true_random=False),
)
def test_random_workloads_keep_invariants(
    ops, num_blocks, block_size, budget, max_num_seqs, threshold, policy, watermark, overlap, seed
):
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        policy=policy,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        watermark=watermark,
        max_waiting=20,
    )
    added = []
    in_flight = []  # with overlap, step N is applied only after step N+1 was scheduled

    def finish_step(out) -> None:
        sampled = {}
        for rid in out.sampling_req_ids:
            if rid not in sched.requests:
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            accepted = drafts[: seed.randrange(len(drafts) + 1)]
            sampled[rid] = [*accepted, EOS if seed.random() < 0.05 else seed.randrange(3, 9)]
        sched.clock.now += 0.01
        sched.update(out, RunnerOutput(sampled))
        sched.check_integrity()

    def run_step(num_drafts: int) -> None:
        running = [r for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        # Drafts and overlap do not mix (as in vLLM): a draft's fate is known one step late.
        if num_drafts and running and not overlap:
            running[0].spec_token_ids = [seed.randrange(3, 9) for _ in range(num_drafts)]
        out = sched.schedule()
        sched.check_integrity()
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.num_scheduled_tokens) <= max_num_seqs
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        assert out.sampling_req_ids <= set(out.num_scheduled_tokens)
        in_flight.append(out)
        if len(in_flight) > (1 if overlap else 0):
            finish_step(in_flight.pop(0))

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority, shared, count, ttft_ms = op
            for _ in range(count):
                # Ids and prompts from local state only, so every replay draws the same data.
                k = len(added) + 1000
                prompt = [5] * prompt_len if shared else [k * 31 + j for j in range(prompt_len)]
                req = make_request(
                    prompt,
                    request_id=f"r{k}",
                    max_tokens=max_tokens,
                    priority=priority,
                    slo=SLO(ttft_ms=ttft_ms, tpot_ms=50.0) if ttft_ms else None,
                    ignore_eos=seed.random() < 0.5,
                )
                req.arrival_time = sched.clock.now
                try:
                    sched.add_request(req)
                except (ValueError, QueueFullError):
                    continue
                added.append(req)
        elif op[0] == "step":
            run_step(op[1])
        elif added:
            victim = added[op[1] % len(added)]
            sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            sched.check_integrity()

    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        run_step(0)
    while in_flight:
        finish_step(in_flight.pop(0))
    assert not sched.has_unfinished_requests(), "requests never finished"
    assert all(r.is_finished for r in added)
    for r in added:
        if r.status == RequestStatus.FINISHED_REJECTED:
            assert r.stop_reason, "rejected without a reason"
        assert all(b.ref_cnt >= 0 for b in sched.kv.pool.blocks)
    assert sched.kv.num_free_blocks == num_blocks
    assert not sched.kv.req_to_blocks
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {sched.kv.prefix_stats.hits > 0}")
    event(f"rejected: {any(r.status == RequestStatus.FINISHED_REJECTED for r in added)}")
    assert all(r.num_output_placeholders == 0 for r in added)
