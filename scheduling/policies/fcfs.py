"""First come, first served."""

from __future__ import annotations

from scheduling.policy import BasePolicy
from scheduling.request import Request


class FCFSPolicy(BasePolicy):
    """Rank by arrival: the oldest runs first and the newest is the preemption victim (as vLLM)."""

    name = "fcfs"

    def rank(self, req: Request, now: float) -> tuple[float, str]:
        return (req.arrival_time, req.request_id)
