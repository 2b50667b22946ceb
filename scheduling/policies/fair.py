"""Fair share across tenants: the Virtual Token Counter (VTC; Sheng et al., OSDI'24).

Each tenant t has a counter c_t of the weighted service it has had, divided by its weight:

    c_t += (w_p * prefill tokens + w_q * decode tokens) / weight_t      (every step)

and the backlogged tenant with the smallest counter goes first. A tenant that comes back
after a while with nothing waiting is lifted to the smallest counter among the tenants
that were waiting, so idle time banks no credit. Ranks are the counters themselves, so the
scheduler's rules do the rest: a waiting request of a starved tenant preempts the running
request of the tenant furthest ahead (the highest rank) when seats or blocks run out.

```
rank(req) = (c_tenant - margin if running else c_tenant, arrival, id)     lower runs first
```

Bound: while tenants f and g are both backlogged, |c_f - c_g| <= `counter_bound` (U), so
the weighted service either gets over any interval of that time differs by at most 2U.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from scheduling.config import SchedulerConfig
from scheduling.cost_model import StepCostModel
from scheduling.output import StepStats
from scheduling.policy import ACCEPT, Admission, BasePolicy, LoadView
from scheduling.request import Request, RequestStatus


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """`--tenant-weights a=2,b=1`: each tenant's share under `fair` (others weigh 1)."""
    weights: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.strip().partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name.strip() or not weight > 0 or math.isinf(weight):
            raise ValueError(f"tenant_weights: {part.strip()!r} is not TENANT=WEIGHT (> 0)")
        weights[name.strip()] = weight
    return weights


# Counters kept before those of idle tenants at the floor are forgotten.
MAX_IDLE_TENANTS = 4096


class FairPolicy(BasePolicy):
    """VTC: serve the backlogged tenant with the least weighted service first.

    `weights`: tenant -> share (default 1; a tenant of weight 2 gets twice the service of
    a tenant of weight 1 while both are backlogged). `prefill_weight` / `decode_weight`
    (VTC's w_p and w_q) price a prompt and an output token; by default w_p = 1 and w_q is
    the cost model's decode/prefill cost ratio. `preemption_margin` (weighted tokens): a
    running request ranks as if its tenant had had that much less service, so a waiting
    request evicts it only when its tenant is that far behind; without it two tenants'
    requests evict each other in turn as their counters cross (recompute, not service).
    """

    name = "fair"

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        prefill_weight: float | None = None,
        decode_weight: float | None = None,
        cost: StepCostModel | None = None,
        preemption_margin: float | None = None,
    ) -> None:
        cost = cost or StepCostModel()
        self.w_p = 1.0 if prefill_weight is None else float(prefill_weight)
        ratio = cost.per_decode_token_s / cost.per_prefill_token_s
        self.w_q = ratio * self.w_p if decode_weight is None else float(decode_weight)
        self.weights = dict(weights or {})
        for tenant, weight in self.weights.items():
            if not weight > 0:
                raise ValueError(f"tenant_weights: {tenant!r} must be > 0, got {weight}")
        if self.w_p < 0 or self.w_q < 0 or self.w_p + self.w_q == 0:
            raise ValueError("fair: prefill and decode weights must be >= 0, not both 0")
        if preemption_margin is not None and preemption_margin < 0:
            raise ValueError(f"preemption_margin: must be >= 0, got {preemption_margin}")
        self._fixed_margin = preemption_margin
        # By default two full steps of prefill (the step budget comes with the first
        # LoadView): in the simulator that is the least margin with no preemption thrash.
        self.margin = float(
            preemption_margin
            if preemption_margin is not None
            else 2 * self.w_p * SchedulerConfig().max_num_batched_tokens
        )
        self.counters: dict[str, float] = {}
        # Tenants with a request waiting in this step's ranking and in the previous step's;
        # a step ends at `observe` (the engine calls it once per step).
        self._waiting_now: set[str] = set()
        self._waiting_prev: set[str] = set()
        # The least counter among the last non-empty waiting set: where a tenant that finds
        # the engine idle starts.
        self._floor = 0.0
        # Weighted prompt cost of each tenant's waiting requests ranked so far this step.
        self._queued: dict[str, float] = {}
        self._ranked_at: float | None = None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter_bound(self, config: SchedulerConfig) -> float:
        """U: how far apart two backlogged tenants' counters can get.

        Ranks are compared once per step, so a tenant pulls ahead of a waiting one by at
        most the margin its running requests enjoy plus what one step can give it: the
        step budget at the prefill price, its decode tokens at the decode price (the
        lightest weight divides both).
        """
        lightest = min([1.0, *self.weights.values()])
        budget = config.max_num_batched_tokens
        step = self.w_p * budget + max(0.0, self.w_q - self.w_p) * min(budget, config.max_num_seqs)
        return self.margin + step / lightest

    def admit(self, req: Request, load: LoadView, now: float) -> Admission:
        if self._fixed_margin is None:
            self.margin = 2 * self.w_p * load.max_num_batched_tokens
        return ACCEPT

    def rank(self, req: Request, now: float) -> tuple[float, float, str]:
        tenant = req.tenant
        if now != self._ranked_at:
            # A new step's ranking (all ranks of one step share its `now`).
            self._ranked_at, self._queued = now, {}
        counter = self.counters.get(tenant, self._floor)
        if req.status == RequestStatus.RUNNING:
            return (counter - self.margin, req.arrival_time, req.request_id)
        if tenant not in self._waiting_now:
            self._waiting_now.add(tenant)
            if tenant not in self._waiting_prev:
                self._lift(tenant)
                counter = self.counters[tenant]
        # Counters move once per step, so a tenant's later waiting requests rank as if its
        # earlier ones (in queue order) had been served: one step admits tenants in turn,
        # by weighted prompt cost, instead of whoever arrived first filling every seat.
        ahead = self._queued.get(tenant, 0.0)
        cost = self.w_p * max(1, req.num_tokens - req.num_computed_tokens)
        self._queued[tenant] = ahead + cost / self.weight(tenant)
        return (counter + ahead, req.arrival_time, req.request_id)

    def _lift(self, tenant: str) -> None:
        """A returning tenant joins at the least counter of those waiting: no banked credit."""
        others = [self.counters[t] for t in self._waiting_prev if t in self.counters]
        floor = min(others) if others else self._floor
        self.counters[tenant] = max(self.counters.get(tenant, floor), floor)

    def observe(self, stats: StepStats) -> None:
        for tenant, tokens in stats.shape.tenant_tokens.items():
            service = self.w_p * tokens.prefill + self.w_q * tokens.decode
            self.counters[tenant] = self.counters.get(tenant, self._floor) + service / self.weight(
                tenant
            )
        self._waiting_prev, self._waiting_now = self._waiting_now, set()
        self._queued = {}
        if self._waiting_prev:
            self._floor = min(self.counters.get(t, self._floor) for t in self._waiting_prev)
        if len(self.counters) > MAX_IDLE_TENANTS:
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop counters at or below the floor of tenants not waiting (tenant names come
        from clients: the map must not grow without end). Nothing is lost: such a tenant
        would be lifted to the floor when it came back anyway."""
        self.counters = {
            t: c for t, c in self.counters.items() if c > self._floor or t in self._waiting_prev
        }
