"""What the engine hands out: a `Delta` per request per step, a `Completion` per script run."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling import RequestOutput


@dataclass(slots=True)
class Delta(RequestOutput):
    """A step's `RequestOutput` for one request, plus the text its new tokens decode to.

    Plain data (it crosses process boundaries to a front door as it is).
    """

    text: str = ""
    # Set when the request was bad in a way found only inside the engine (its grammar does
    # not compile): the API answers 400 with this message.
    bad_request: str | None = None

    @classmethod
    def ending(cls, request_id: str, finish_reason: str, why: str) -> Delta:
        """A request's last delta when it ends without new tokens (error, abort)."""
        return cls(request_id, [], finish_reason, why)


@dataclass(slots=True)
class Completion:
    """A finished request, for `Engine.generate`."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Why a constrained request could not start (its grammar did not compile).
    error: str | None = None
