"""Speculative-decoding counters: how many drafts were offered, verified and accepted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start (engine-wide) or over one request's life."""

    # Drafts the proposer offered (after the max_tokens / max_model_len caps).
    num_proposed: int = 0
    # Drafts scheduled for verification (fewer than proposed when budget or blocks ran short).
    num_verified: int = 0
    # Verified drafts the target model accepted.
    num_accepted: int = 0
    # Request-steps that verified at least one draft.
    num_verify_steps: int = 0

    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verified += num_drafts
        self.num_accepted += num_accepted
        self.num_verify_steps += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_verified if self.num_verified else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request-step emits on average: 1 + accepted drafts."""
        return 1 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 0.0
