"""How many drafts each request gets: fewer for a request whose drafts keep failing.

Verifying k drafts adds k token rows to the forward. On a GPU at small batch that is
nearly free; on a CPU the forward is compute-bound even at batch 1 (measured: 5 rows cost
about 1.5-2x one row for the embedded model), so drafts that are rejected make open-ended
text slower. Each request keeps a moving average of the fraction of its drafts accepted,
and gets `round(k * average)` drafts; at 0 it still probes with one draft every
`probe_every` steps, so a request that starts copying later is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Track:
    rate: float
    idle_steps: int = 0


class AdaptiveDraftLength:
    """Per-request draft caps from recent acceptance; deterministic in the request's own
    history, so greedy outputs and seeded samples do not depend on the batch."""

    def __init__(
        self, k: int, initial_rate: float = 0.5, weight: float = 0.3, probe_every: int = 8
    ) -> None:
        self.k, self.initial_rate = k, initial_rate
        self.weight, self.probe_every = weight, probe_every
        self.tracks: dict[str, _Track] = {}

    def cap(self, req_id: str) -> int:
        """Drafts to propose for `req_id` this step (0: skip it)."""
        track = self.tracks.setdefault(req_id, _Track(self.initial_rate))
        n = round(self.k * track.rate)
        if n > 0:
            return n
        track.idle_steps += 1
        if track.idle_steps >= self.probe_every:
            track.idle_steps = 0
            return 1
        return 0

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        track = self.tracks.setdefault(req_id, _Track(self.initial_rate))
        track.rate += self.weight * (num_accepted / num_drafts - track.rate)

    def drop(self, req_id: str) -> None:
        self.tracks.pop(req_id, None)
