"""The `fair` policy (VTC): counters, lifting, weights, victims, and its bound in simulation."""

from __future__ import annotations

from collections import defaultdict

import pytest

from conftest import FakeClock, make_request, sample_all
from kvcache import KVCacheManager
from plugins import load_policy
from scheduling import Scheduler, SchedulerConfig, SchedulerOutput, StepStats
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
    """Simulate; per step: the tenants still waiting and each tenant's weighted service /
    weight so far, counted from the steps' shapes with the fair policy's prices."""
    policy = load_policy(policy_name, **options)
    prices = policy if isinstance(policy, FairPolicy) else FairPolicy(**options)  # type: ignore[arg-type]
    served: dict[str, float] = defaultdict(float)
    history: list[tuple[frozenset[str], dict[str, float]]] = []

    def on_step(sched: Scheduler, out: SchedulerOutput) -> None:
        for tenant, tokens in out.shape.tenant_tokens.items():
            cost = prices.w_p * tokens.prefill + prices.w_q * tokens.decode
            served[tenant] += cost / prices.weight(tenant)
        history.append((frozenset(r.tenant for r in sched.waiting), dict(served)))

    result = simulate(trace, policy, config=CONFIG, on_step=on_step)
    return result, history, prices


def worst_interval_gap(history) -> float:
    """max over tenant pairs and intervals in which both stay backlogged of
    |W_f(t1, t2) - W_g(t1, t2)| (weighted): the spread of their difference over each
    common backlogged run."""
    tenants = sorted({t for backlog, _ in history for t in backlog})
    worst = 0.0
    for i, f in enumerate(tenants):
        for g in tenants[i + 1 :]:
            lo = hi = None
            for backlog, served in history:
                if f in backlog and g in backlog:
                    d = served.get(f, 0.0) - served.get(g, 0.0)
                    lo, hi = (d, d) if lo is None else (min(lo, d), max(hi, d))
                    worst = max(worst, hi - lo)
                else:
                    lo = hi = None
    return worst


def shares_while_all_backlogged(history, tenants: list[str], weights: dict[str, float]):
    """Each tenant's service over the steps in which every tenant waits, over its
    weighted fair share of the total."""
    steps = [i for i, (backlog, _) in enumerate(history) if backlog >= set(tenants)]
    assert len(steps) > 100, "the trace should keep every tenant backlogged a while"
    start, end = history[steps[0]][1], history[steps[-1]][1]
    # served[] is already service / weight: back to raw service to split the total.
    got = {t: (end.get(t, 0) - start.get(t, 0)) * weights.get(t, 1.0) for t in tenants}
    total, wsum = sum(got.values()), sum(weights.get(t, 1.0) for t in tenants)
    return {t: got[t] / (total * weights.get(t, 1.0) / wsum) for t in tenants}


@pytest.fixture(scope="module")
def trace():
    return four_tenant_trace()


@pytest.fixture(scope="module")
def fcfs_run(trace):
    return run_recorded("fcfs", trace)


def test_fair_keeps_vtc_bound_and_fair_shares_at_fcfs_throughput(trace, fcfs_run) -> None:
    fcfs, fcfs_history, _ = fcfs_run
    fair, history, policy = run_recorded("fair", trace)
    bound = 2 * policy.counter_bound(CONFIG)
    gap = worst_interval_gap(history)
    assert gap <= bound, f"service gap {gap:.0f} over VTC's bound {bound:.0f}"
    tenants = ["heavy", "light0", "light1", "light2"]
    shares = shares_while_all_backlogged(history, tenants, {})
    for light in tenants[1:]:
        assert shares[light] >= 0.95, shares
    assert fair.summary["tok_s"] >= 0.95 * fcfs.summary["tok_s"]
    # The same checks have teeth: under fcfs the heavy tenant takes ~3/4 of the engine.
    assert worst_interval_gap(fcfs_history) > 10 * bound
    fcfs_shares = shares_while_all_backlogged(fcfs_history, tenants, {})
    assert all(fcfs_shares[t] < 0.5 for t in tenants[1:])


def test_weighted_tenant_gets_its_weighted_share(trace) -> None:
    weights = {"light0": 2.0}
    _, history, policy = run_recorded("fair", trace, weights=weights)
    assert worst_interval_gap(history) <= 2 * policy.counter_bound(CONFIG)
    shares = shares_while_all_backlogged(history, ["heavy", "light0", "light1", "light2"], weights)
    assert all(share >= 0.95 for name, share in shares.items() if name != "heavy"), shares
