"""Measuring fair share in the simulator: per-step backlog and weighted service per tenant.

`ServiceRecorder` is an `on_step` hook for `simulate`; it prices each step's per-tenant
tokens as the `fair` policy does (w_p, w_q, divided by the tenant's weight), whatever
policy runs, so fcfs and fair are measured alike.
"""

from __future__ import annotations

from collections import defaultdict

from scheduling.output import SchedulerOutput
from scheduling.policies.fair import FairPolicy
from scheduling.scheduler import Scheduler


class ServiceRecorder:
    """After every step: the tenants still waiting, and each one's service / weight so far."""

    def __init__(self, prices: FairPolicy) -> None:
        self.prices = prices
        self.served: dict[str, float] = defaultdict(float)
        self.history: list[tuple[frozenset[str], dict[str, float]]] = []

    def __call__(self, sched: Scheduler, out: SchedulerOutput) -> None:
        p = self.prices
        for tenant, tokens in out.shape.tenant_tokens.items():
            cost = p.w_p * tokens.prefill + p.w_q * tokens.decode
            self.served[tenant] += cost / p.weight(tenant)
        self.history.append((frozenset(r.tenant for r in sched.waiting), dict(self.served)))

    def worst_interval_gap(self) -> float:
        """max over tenant pairs f, g and intervals in which both stay backlogged of
        |W_f(t1, t2)/w_f - W_g(t1, t2)/w_g|: the spread of their difference over each
        common backlogged run (VTC's bound is 2U)."""
        tenants = sorted({t for backlog, _ in self.history for t in backlog})
        worst = 0.0
        for i, f in enumerate(tenants):
            for g in tenants[i + 1 :]:
                lo = hi = None
                for backlog, served in self.history:
                    if f in backlog and g in backlog:
                        d = served.get(f, 0.0) - served.get(g, 0.0)
                        lo, hi = (d, d) if lo is None else (min(lo, d), max(hi, d))
                        worst = max(worst, hi - lo)
                    else:
                        lo = hi = None
        return worst

    def all_backlogged_steps(self, tenants: list[str]) -> list[int]:
        return [i for i, (backlog, _) in enumerate(self.history) if backlog >= set(tenants)]

    def shares(self, tenants: list[str]) -> dict[str, float]:
        """Each tenant's service over the steps in which all of `tenants` wait, over its
        weighted fair share of what they got together (1.0 = exactly its share)."""
        steps = self.all_backlogged_steps(tenants)
        if not steps:
            return {t: float("nan") for t in tenants}
        start, end = self.history[steps[0]][1], self.history[steps[-1]][1]
        weight = self.prices.weight
        # served is service / weight: back to raw service to split the total.
        got = {t: (end.get(t, 0.0) - start.get(t, 0.0)) * weight(t) for t in tenants}
        total, wsum = sum(got.values()), sum(weight(t) for t in tenants)
        return {t: got[t] / (total * weight(t) / wsum) for t in tenants}


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one takes everything."""
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if square > 0 else float("nan")
