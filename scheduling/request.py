"""A request's state and progress: the only object that moves through the scheduler.

```
WAITING --(grammar needed)--> WAITING_FOR_GRAMMAR --(compiled)--> WAITING
WAITING --(a KV connector supplies prompt blocks)--> WAITING_FOR_KV --(landed)--> WAITING
WAITING --(scheduled, blocks allocated)--> RUNNING
RUNNING --(out of KV blocks, chosen as victim)--> PREEMPTED --> (waiting queue, recompute)
RUNNING --> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED | FINISHED_ERROR
WAITING --(policy or limits say no)--> FINISHED_REJECTED
```
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache import BlockHash
from scheduling.sampling_params import SamplingParams
from scheduling.spec_stats import SpecDecodeStats

# The tenant of a request that names none: every such request shares one.
DEFAULT_TENANT = "default"


class RequestStatus(enum.IntEnum):
    """Everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()
    # Holds blocks a KV connector is filling (scheduling/kv_loads.py); not scheduled meanwhile.
    WAITING_FOR_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REJECTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REJECTED: "rejected",
}


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets of one request; None means no target."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"slo.{name}: must be > 0, got {value}")


@dataclass(slots=True, eq=False)
class Request:
    """One generation request; `num_computed_tokens` is its single progress counter.

    Chunked prefill, prefix-cache hits, decode and speculative tokens all move
    `num_computed_tokens` toward `num_tokens_with_spec`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    # Lower is more urgent, as in vLLM and the OpenAI-compatible extension.
    priority: int = 0
    slo: SLO | None = None
    cache_salt: str | None = None
    # The LoRA adapter it runs with, None for the base model: `lora_id` (its name and a
    # digest of its weights) keys the prefix cache and the --max-loras count; `lora` is the
    # adapter itself, opaque here (runner/lora/ holds the weights).
    lora_id: str | None = None
    lora: object | None = None
    # Who the request is served for: the `fair` policy shares the engine between tenants
    # (the API takes it from `user`, X-Tenant or the API key's name).
    tenant: str = DEFAULT_TENANT
    # Where a KV connector loads this prompt's KV from, for connectors with several sources
    # (a P/D consumer: the KV address of the producer replica that computed it). Set by a
    # front door, never by a client; None: the connector's own (--kv-peer).
    kv_source: str | None = None
    # The compiled grammar its output must obey (opaque here: grammars/ and the runner use
    # it). None while WAITING_FOR_GRAMMAR, and for unconstrained requests.
    grammar: object | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Draft tokens proposed for verification in the next step; never cached, never output.
    spec_token_ids: list[int] = field(default_factory=list)
    # Tokens being sampled by steps in flight, not yet returned. Counting them lets the next
    # step be scheduled before this one ends (the runner fills in the real ids itself).
    num_output_placeholders: int = 0
    # This request's drafts offered, verified and accepted (the per-request log line).
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # Hashes of full blocks of all_token_ids, extended by the KV manager as blocks fill.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Prompt tokens served from the prefix cache when first scheduled (-1: not yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # Why it stopped: the stop token id or string that matched, or a rejection reason.
    stop_reason: int | str | None = None
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + self.num_output_placeholders + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.token_times.append(now)

    def set_drafts(self, drafts: list[int], max_model_len: int) -> None:
        """Take the proposer's drafts for the next step, cut so that even if every one is
        accepted (plus the bonus token) the request stays within max_tokens and max_model_len.
        """
        room = min(
            self.sampling_params.max_tokens - self.num_output_tokens,
            max_model_len - self.num_tokens,
        )
        self.spec_token_ids = drafts[: max(0, room - 1)]
        self.spec_stats.num_proposed += len(self.spec_token_ids)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last output token causes, or None to go on.

        Stop strings are matched on text by the detokenizer, not here.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
