"""A policy's optional cap on one step's tokens, kept while the step is built.

A policy may define `step_token_cap(req, now) -> int | None`: the most tokens the step
may hold once `req` is in it (None: only the config's budget). The priority policy caps
its less urgent work this way so that steps stay short while urgent requests are about;
`min_tokens` (the policy's `min_background_tokens`) of capped work still fit every step,
so capped requests slow down but never starve.
"""

from __future__ import annotations

from typing import Any

from scheduling.request import Request
from scheduling.step_builder import StepBuilder


class StepCap:
    """Room left for the next request of a step under the policy's cap."""

    def __init__(self, policy: Any, now: float) -> None:
        self._cap = getattr(policy, "step_token_cap", None)
        self._min_tokens = int(getattr(policy, "min_background_tokens", 1))
        self._now = now
        # Tokens given to capped requests so far this step.
        self._capped_tokens = 0
        self._last_capped = False

    def room(self, req: Request, step: StepBuilder, whole: bool = False) -> int:
        """Tokens `req` may take (<= the step's budget); 0 when the cap is reached. `whole`:
        `req` cannot be chunked (a prompt with chunked prefill off), so it is not capped."""
        cap = self._cap(req, self._now) if self._cap is not None and not whole else None
        self._last_capped = cap is not None
        if cap is None:
            return step.budget
        used = step.num_tokens
        room = max(cap - used, self._min_tokens - self._capped_tokens)
        return max(0, min(step.budget, room))

    def took(self, num_tokens: int) -> None:
        """What the request last passed to `room` took."""
        if self._last_capped:
            self._capped_tokens += num_tokens
