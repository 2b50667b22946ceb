"""The proposer interface: `propose(requests) -> drafts per request`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

# Bumped when DraftRequest or Proposer change incompatibly; plugins declare the one they target.
PROPOSER_API_VERSION = 1


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """What a proposer sees of one request after a step: its tokens and its draft budget."""

    req_id: str
    # Prompt + output so far, the token just sampled last. Read-only: do not mutate.
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # Most drafts this request takes this time (engine k, capped per request); >= 1.
    max_drafts: int


@runtime_checkable
class Proposer(Protocol):
    """Guesses the tokens that follow each request's context.

    Contract: `propose` returns one list per request, in order, each at most `max_drafts`
    long (an empty list means "no guess"). Proposals may be wrong: the target model
    verifies them, and the output distribution is the target's whatever is proposed. A
    proposer must be deterministic given its input (the verifier treats its guess as a
    one-hot draft distribution). It runs on the runner thread, right after sampling, and
    its time adds to every step: keep it cheap. Constructed as `cls(config)`.
    """

    name: ClassVar[str]
    api_version: ClassVar[int]

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...
