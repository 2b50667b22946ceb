"""Strict priority classes, FCFS within a class."""

from __future__ import annotations

from scheduling.policy import BasePolicy
from scheduling.request import Request


class PriorityPolicy(BasePolicy):
    """Rank by (priority, arrival); lower priority values are more urgent.

    Because the scheduler lets a waiting request preempt a lower-ranked running one, an
    urgent request gets in under load instead of only moving up the queue.
    """

    name = "priority"

    def rank(self, req: Request, now: float) -> tuple[int, float, str]:
        return (req.priority, req.arrival_time, req.request_id)
