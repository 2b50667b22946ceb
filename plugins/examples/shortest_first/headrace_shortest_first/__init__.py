"""An example third-party headrace policy: shortest remaining work first."""

from __future__ import annotations

from scheduling import ACCEPT, POLICY_API_VERSION, Admission, LoadView, Request, StepStats


class ShortestFirstPolicy:
    """Rank by remaining work (prompt left to prefill + tokens left to generate).

    Short jobs finish first, which minimises mean latency; long ones are the preemption
    victims. Written against the Policy protocol only, without subclassing anything.
    """

    name = "shortest-first"
    api_version = POLICY_API_VERSION

    def rank(self, req: Request, now: float) -> tuple[int, float]:
        left_to_prefill = max(0, req.num_prompt_tokens - req.num_computed_tokens)
        left_to_generate = req.sampling_params.max_tokens - req.num_output_tokens
        return (left_to_prefill + left_to_generate, req.arrival_time)

    def admit(self, req: Request, load: LoadView, now: float) -> Admission:
        return ACCEPT

    def observe(self, stats: StepStats) -> None:
        return None
