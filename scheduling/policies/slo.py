"""Least slack first, with load shedding of requests that can no longer meet their TTFT."""

from __future__ import annotations

import math

from scheduling.cost_model import OnlineCostModel, StepCostModel
from scheduling.output import StepStats
from scheduling.policy import ACCEPT, Admission, BasePolicy, LoadView, reject
from scheduling.request import Request, RequestStatus


class SLOPolicy(BasePolicy):
    """Rank by slack = deadline - now - predicted remaining work of the next milestone.

    Before the first token the milestone is the TTFT deadline (arrival + ttft_ms) and the
    work is the remaining prefill. After it, the deadline of output token k is
    first_token_time + k * tpot_ms: a request that fell behind its average TPOT has little
    slack and catches up. Requests without an SLO have infinite slack and run FCFS among
    themselves; requests whose slack is already negative run last. Step costs come from an
    online least-squares fit of observed steps.
    """

    name = "slo"

    def __init__(
        self,
        shed: bool = True,
        prior: StepCostModel | None = None,
        urgency_horizon_s: float = 1.0,
        preemption_margin_s: float = 0.5,
    ) -> None:
        self.shed = shed
        self.cost = OnlineCostModel(prior)
        # Slack beyond this is "not urgent": such requests tie and run FCFS. Without it two
        # relaxed requests evict each other in turn, since a running one gains slack while a
        # waiting one loses it.
        self.urgency_horizon_s = urgency_horizon_s
        # Running requests rank as if they had this much less slack, so a waiting request
        # must be that much more urgent to evict one: each recompute buys at least this much
        # run time (time slicing without thrashing).
        self.preemption_margin_s = preemption_margin_s

    def rank(self, req: Request, now: float) -> tuple[int, float, float, str]:
        slack = self.slack(req, now)
        if slack < 0:
            # A lost cause: serving it first would only make feasible requests miss too (the
            # EDF domino effect under overload). It runs, FCFS, after every feasible request.
            return (1, 0.0, req.arrival_time, req.request_id)
        urgency = min(slack, self.urgency_horizon_s)
        if req.status == RequestStatus.RUNNING:
            urgency -= self.preemption_margin_s
        return (0, urgency, req.arrival_time, req.request_id)

    def slack(self, req: Request, now: float) -> float:
        slo = req.slo
        if slo is None:
            return math.inf
        remaining = req.num_tokens - req.num_computed_tokens
        first_token_time = req.first_token_time
        if first_token_time is None:
            if slo.ttft_ms is None:
                return math.inf
            deadline = req.arrival_time + slo.ttft_ms / 1000
            return deadline - now - self.cost.prefill_time(remaining)
        if slo.tpot_ms is None:
            return math.inf
        deadline = first_token_time + req.num_output_tokens * slo.tpot_ms / 1000
        # NOTE: the work counted is the recompute cost even while the request runs, so its
        # rank does not jump when it is preempted: a waiting request must beat a running one
        # by that cost to evict it, which keeps two requests from evicting each other in turn.
        return deadline - now - self.cost.prefill_time(req.num_tokens)

    def admit(self, req: Request, load: LoadView, now: float) -> Admission:
        slo = req.slo
        if not self.shed or slo is None or slo.ttft_ms is None or req.output_token_ids:
            return ACCEPT
        waited_ms = (now - req.arrival_time) * 1000
        prefill_ms = self.cost.prefill_time(req.num_tokens) * 1000
        if waited_ms + prefill_ms > slo.ttft_ms:
            return reject(
                f"slo.ttft_ms={slo.ttft_ms:g} cannot be met: waited {waited_ms:.0f} ms and "
                f"the prompt needs ~{prefill_ms:.0f} ms"
            )
        return ACCEPT

    def observe(self, stats: StepStats) -> None:
        self.cost.observe(stats.shape, stats.duration_s)
