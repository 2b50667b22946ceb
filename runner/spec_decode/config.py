"""Engine-wide speculative decoding settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Which proposer, and how many drafts it may offer per request and step."""

    # "none" turns speculation off; otherwise a name in the headrace.proposers group.
    method: str = "none"
    # Most draft tokens per request per step (k); a step then computes up to 1 + k tokens.
    num_speculative_tokens: int = 3
    # n-gram proposer: shortest and longest suffix it tries to find earlier in the context.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Give requests whose drafts keep failing fewer drafts (runner/spec_decode/draft_length.py).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min, prompt_lookup_max: need 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "none"
