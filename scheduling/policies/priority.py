"""Strict priority classes, FCFS within a class."""

from __future__ import annotations

from scheduling.policy import BasePolicy
from scheduling.request import Request


class PriorityPolicy(BasePolicy):
    """Rank by (priority, arrival); lower priority values are more urgent.

    Because the scheduler lets a waiting request preempt a lower-ranked running one, an
    urgent request gets in under load instead of only moving up the queue. The step that
    admits it carries nothing of lower priority (`urgent_prefill_alone`).
    """

    name = "priority"
    # Live, an urgent prompt admitted into a step that also ran the whole batch's decodes
    # and other prompts' chunks took ~1.9x its idle TTFT; alone in its step it takes ~1x
    # plus the wait for the step in flight.
    urgent_prefill_alone = True

    def rank(self, req: Request, now: float) -> tuple[int, float, str]:
        return (req.priority, req.arrival_time, req.request_id)
