"""The `fair` policy (VTC): counters, lifting, weights, victims, and its bound in simulation."""

from __future__ import annotations

import pytest

from conftest import FakeClock, make_request, sample_all
from kvcache import KVCacheManager
from plugins import load_policy
from scheduling import Scheduler, SchedulerConfig, SchedulerOutput, StepStats
from scheduling.fairness import ServiceRecorder
from scheduling.policies.fair import FairPolicy
from scheduling.simulator import simulate
from scheduling.trace import TraceClass, make_trace


def fair_scheduler(policy: FairPolicy, **cfg: object) -> Scheduler:
    cfg.setdefault("watermark", 0.0)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(64, 4), policy, FakeClock())


def tenant_request(tenant: str, prompt: int = 8, max_tokens: int = 4):
    req = make_request(prompt, max_tokens)
    req.tenant = tenant
    return req


def fair_step(sched: Scheduler) -> SchedulerOutput:
    """One step as the engine runs it: schedule, observe (the policy charges), update."""
    out = sched.schedule()
    if not out.is_empty:
        sched.observe_step(StepStats(out.shape, 0.01))
    sched.update(out, sample_all(sched, out))
    sched.check_integrity()
    return out


def test_step_shape_splits_tokens_by_tenant() -> None:
    sched = fair_scheduler(FairPolicy(), max_num_batched_tokens=64)
    for tenant in ("a", "a", "b"):
        sched.add_request(tenant_request(tenant, prompt=8))
    first = fair_step(sched)
    assert {t: (x.prefill, x.decode) for t, x in first.shape.tenant_tokens.items()} == {
        "a": (16, 0),
        "b": (8, 0),
    }
    second = fair_step(sched)
    tokens = second.shape.tenant_tokens
    assert (tokens["a"].decode, tokens["b"].decode) == (2, 1)
    assert sum(t.decode for t in tokens.values()) == second.shape.num_decode_tokens


def test_defaults_price_tokens_from_the_cost_model() -> None:
    policy = load_policy("fair")
    assert isinstance(policy, FairPolicy)
    # StepCostModel: 40 us a prefill token, 80 us a decode token.
    assert (policy.w_p, policy.w_q) == (1.0, 2.0)
    with pytest.raises(ValueError, match="tenant_weights: 'a' must be > 0"):
        FairPolicy(weights={"a": 0})
    with pytest.raises(ValueError, match="preemption_margin"):
        FairPolicy(preemption_margin=-1)


def test_least_served_tenant_goes_first_and_a_returning_one_banks_nothing() -> None:
    policy = FairPolicy()
    sched = fair_scheduler(policy, max_num_batched_tokens=8, max_num_seqs=1)
    for _ in range(3):
        sched.add_request(tenant_request("a", prompt=8, max_tokens=1))
    fair_step(sched)  # a's first request prefills (8 tokens, w_p = 1): a is at 8
    assert policy.counters["a"] == 8
    first_a = [r for r in sched.waiting if r.tenant == "a"]
    late_b = tenant_request("b", prompt=8, max_tokens=1)
    sched.add_request(late_b)
    out = fair_step(sched)
    # b is new: lifted to the least waiting counter (a's, 8), so it ties with a; ties go
    # by arrival, so a's next request runs and b waits one step...
    assert policy.counters["b"] == 8
    assert list(out.num_scheduled_tokens) == [first_a[0].request_id]
    assert policy.counters["a"] == 16
    # ...then b, now the least served, goes before a's third request.
    out = fair_step(sched)
    assert list(out.num_scheduled_tokens) == [late_b.request_id]


def test_one_step_admits_tenants_in_turn_not_by_arrival() -> None:
    # Everyone arrives at once, the heavy tenant first with 6 requests; 4 seats.
    sched = fair_scheduler(FairPolicy(), max_num_batched_tokens=256, max_num_seqs=4)
    heavy = [tenant_request("heavy") for _ in range(6)]
    light = [tenant_request(t) for t in ("a", "b", "c")]
    for req in [*heavy, *light]:
        sched.add_request(req)
    out = fair_step(sched)
    # All counters are 0, but each tenant's second request ranks behind everyone's first.
    assert set(out.num_scheduled_tokens) == {heavy[0].request_id} | {r.request_id for r in light}
    # Under fcfs the heavy tenant takes every seat.
    fcfs = fair_scheduler(load_policy("fcfs"), max_num_batched_tokens=256, max_num_seqs=4)
    for req in [tenant_request("heavy") for _ in range(6)]:
        fcfs.add_request(req)
    fcfs.add_request(tenant_request("a"))
    assert {fcfs.requests[r].tenant for r in fair_step(fcfs).num_scheduled_tokens} == {"heavy"}


def test_idle_tenant_is_lifted_to_the_floor() -> None:
    policy = FairPolicy()
    policy.counters = {"a": 500.0, "b": 900.0}
    policy._waiting_prev = {"a", "b"}
    late = tenant_request("c")
    policy.rank(late, 0.0)
    assert policy.counters["c"] == 500.0
    # A tenant that already had more than the floor keeps it (no refund either).
    policy.counters["d"] = 700.0
    policy.rank(tenant_request("d"), 0.0)
    assert policy.counters["d"] == 700.0


def test_heaviest_tenants_running_request_is_the_victim() -> None:
    policy = FairPolicy(preemption_margin=10)
    sched = fair_scheduler(policy, max_num_batched_tokens=64, max_num_seqs=3)
    heavy = [tenant_request("heavy", prompt=8, max_tokens=50) for _ in range(2)]
    other = tenant_request("mid", prompt=8, max_tokens=50)
    for req in [*heavy, other]:
        sched.add_request(req)
    for _ in range(3):
        fair_step(sched)
    assert policy.counters["heavy"] > policy.counters["mid"] + 10
    light = tenant_request("light")
    sched.add_request(light)
    out = fair_step(sched)
    # The seats are full: the starved tenant takes the newest request of the tenant
    # furthest ahead, not mid's.
    assert out.preempted_req_ids == {heavy[1].request_id}
    assert light.request_id in out.num_scheduled_tokens
    assert other in sched.running


# -- the proof in the simulator ----------------------------------------------------------

CONFIG = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=4096)


def four_tenant_trace(rate: float = 100.0, duration_s: float = 1.5):
    """One heavy tenant at 10x the request rate of three light ones; all overloaded."""
    classes = [TraceClass("heavy", 10 * rate, 128, 16)]
    classes += [TraceClass(f"light{i}", rate, 128, 16) for i in range(3)]
    return make_trace(classes, duration_s, seed=1)


def run_recorded(policy_name: str, trace, **options: object):
    """Simulate with a ServiceRecorder pricing every step as `fair` would."""
    policy = load_policy(policy_name, **options)
    prices = policy if isinstance(policy, FairPolicy) else FairPolicy(**options)  # type: ignore[arg-type]
    recorder = ServiceRecorder(prices)
    result = simulate(trace, policy, config=CONFIG, on_step=recorder)
    return result, recorder


TENANTS = ["heavy", "light0", "light1", "light2"]


@pytest.fixture(scope="module")
def trace():
    return four_tenant_trace()


@pytest.fixture(scope="module")
def fcfs_run(trace):
    return run_recorded("fcfs", trace)


def test_fair_keeps_vtc_bound_and_fair_shares_at_fcfs_throughput(trace, fcfs_run) -> None:
    fcfs, fcfs_rec = fcfs_run
    fair, rec = run_recorded("fair", trace)
    assert len(rec.all_backlogged_steps(TENANTS)) > 100, "all four should stay backlogged"
    bound = 2 * rec.prices.counter_bound(CONFIG)
    gap = rec.worst_interval_gap()
    assert gap <= bound, f"service gap {gap:.0f} over VTC's bound {bound:.0f}"
    shares = rec.shares(TENANTS)
    for light in TENANTS[1:]:
        assert shares[light] >= 0.95, shares
    assert fair.summary["tok_s"] >= 0.95 * fcfs.summary["tok_s"]
    # The same checks have teeth: under fcfs the heavy tenant takes ~3/4 of the engine.
    assert fcfs_rec.worst_interval_gap() > 10 * bound
    fcfs_shares = fcfs_rec.shares(TENANTS)
    assert all(fcfs_shares[t] < 0.5 for t in TENANTS[1:])


def test_weighted_tenant_gets_its_weighted_share(trace) -> None:
    _, rec = run_recorded("fair", trace, weights={"light0": 2.0})
    assert rec.worst_interval_gap() <= 2 * rec.prices.counter_bound(CONFIG)
    shares = rec.shares(TENANTS)
    # light0 gets 2/5 of the service, the others 1/5 each.
    assert all(share >= 0.95 for name, share in shares.items() if name != "heavy"), shares


def test_simulate_cli_takes_tenants_and_weights(tmp_path, capsys) -> None:
    from daemon.service.cli import main
    from scheduling.trace import dump_trace, load_trace

    trace = four_tenant_trace(rate=20, duration_s=0.2)
    path = tmp_path / "t.jsonl"
    dump_trace(trace, path)
    assert [t.tenant for t in load_trace(path)] == [t.tenant for t in trace]
    assert {t.tenant for t in trace} == set(TENANTS)
    argv = ["simulate", "--trace", str(path), "--tenant-weights", "light0=2"]
    assert main([*argv, "--policy", "fair"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT goodput=")
    assert main([*argv, "--policy", "fcfs"]) == 2
    assert "only the fair policy" in capsys.readouterr().err
