"""The policy plug-in point: who goes first, who gets in, and what was learned.

A policy decides *who goes first*; the scheduler decides *how many tokens fit*.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from scheduling.output import StepStats
from scheduling.request import Request

# Bumped when the Policy protocol changes incompatibly; plugins declare the one they target.
POLICY_API_VERSION = 1


class Decision(enum.Enum):
    ACCEPT = "accept"
    # Leave it waiting this step; it is asked again next step.
    DEFER = "defer"
    # Finish it as FINISHED_REJECTED with the reason (the API answers 429/503).
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Admission:
    """A policy's answer for one waiting request."""

    decision: Decision
    reason: str = ""


ACCEPT = Admission(Decision.ACCEPT)
DEFER = Admission(Decision.DEFER)


def reject(reason: str) -> Admission:
    return Admission(Decision.REJECT, reason)


@dataclass(frozen=True, slots=True)
class LoadView:
    """A read-only snapshot of engine load, taken once per step for admission."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    block_size: int
    # Prompt tokens still to prefill across waiting requests.
    num_waiting_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int


@runtime_checkable
class Policy(Protocol):
    """Orders and admits requests. Ranks compare with `<`; lower runs first.

    Contract: `rank` is called once per request per step and must not mutate the request;
    the running request with the highest rank is the preemption victim, and a waiting
    request ranked strictly below a running one may preempt it.

    Optional class attribute `urgent_prefill_alone` (read with getattr, default False;
    not a protocol member, so older plugins still match): a step that admits a new
    request ranked above running ones carries nothing ranked below it, so that request's
    first token is not slowed by the batch it jumped (the priority policy's urgent ones).

    Optional method `begin_step(now, requests)` (read with getattr): called once per step,
    before `rank`, with the requests about to be ranked (running, then admissible
    waiting); a policy computes there what holds for the whole step, so that `rank` and
    `step_token_cap` (scheduling/step_cap.py) stay cheap reads.

    Optional method `interrupts(req, step)` (read with getattr): `req` has just arrived
    while a step holding the running requests `step` runs; True asks the engine to stop
    that step between layers and take it back (scheduling/step_undo.py), so that `req`
    need not wait for its end. Only the CPU engine loop without the batch queue can; the
    work already done in the step is lost, so a policy says True only for arrivals that
    outrank the step's work (the priority policy: steps of less urgent work, where its
    own class only decodes).
    """

    name: ClassVar[str]
    api_version: ClassVar[int]

    def rank(self, req: Request, now: float) -> Any: ...

    def admit(self, req: Request, load: LoadView, now: float) -> Admission: ...

    def observe(self, stats: StepStats) -> None: ...


class BasePolicy:
    """Convenience base: accepts everything, learns nothing. Subclasses define `rank`."""

    name: ClassVar[str] = "base"
    api_version: ClassVar[int] = POLICY_API_VERSION
    # See Policy: the step of an urgent first prefill carries nothing ranked below it.
    urgent_prefill_alone: ClassVar[bool] = False

    def rank(self, req: Request, now: float) -> Any:
        raise NotImplementedError

    def admit(self, req: Request, load: LoadView, now: float) -> Admission:
        return ACCEPT

    def observe(self, stats: StepStats) -> None:
        return None
