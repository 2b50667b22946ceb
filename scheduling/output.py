"""Plain dataclasses that cross the scheduler/runner boundary, both ways."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.connectors import KVConnectorMeta
from scheduling.sampling_params import SamplingParams
from scheduling.spec_stats import SpecDecodeStats


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    # Prompt plus any output so far (a resumed request recomputes both).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # The whole block table, prefix-cache hits included.
    block_ids: list[int]
    # Tokens already in the KV cache (prefix hits); computing starts here.
    num_computed_tokens: int
    # The compiled grammar the output obeys, or None (the runner builds its matcher).
    grammar: object | None = None
    # Its LoRA adapter (runner/lora's LoRAAdapter), or None for the base model.
    lora: object | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds; only what changed since its last step."""

    req_id: str
    # Blocks appended to its table this step.
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class TenantTokens:
    """Tokens one tenant (or one priority class) got in one step: what the `fair` policy
    charges a tenant for, and how `priority` tells an urgent step from a capped one."""

    prefill: int = 0
    decode: int = 0


@dataclass(slots=True)
class StepShape:
    """What a step computes, in the units the step-cost model is fitted on."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    # Sum over scheduled requests of the context they attend to (attention cost).
    num_context_tokens: int = 0
    # The same prefill/decode split per tenant (Request.tenant).
    tenant_tokens: dict[str, TenantTokens] = field(default_factory=dict)
    # The same split per priority value (Request.priority).
    priority_tokens: dict[int, TenantTokens] = field(default_factory=dict)


@dataclass(slots=True)
class StepStats:
    """A finished step: its shape and how long it took (fed to Policy.observe)."""

    shape: StepShape
    duration_s: float


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step; it never calls back into the scheduler."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens computed this step (prompt chunk, 1 decode token, or 1 + drafts).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # req_id -> draft tokens to verify; their count is part of num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests that ended since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests evicted since the last step: the runner drops their state (they come back new).
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that reach a sampling position this step (each holds one output placeholder).
    sampling_req_ids: set[str] = field(default_factory=set)
    # KV connector: loads to start and blocks to save after the forward (None: no connector).
    kv_connector_meta: KVConnectorMeta | None = None
    shape: StepShape = field(default_factory=StepShape)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class RunnerOutput:
    """What a step produced: sampled ids for each request that reached a sampling position.

    A prompt chunk that does not reach the end of the prompt has no entry. With speculative
    decoding the list holds the accepted drafts plus one bonus token.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> per sampled token, (logprob of the token, {top token id: logprob}).
    logprobs: dict[str, list[tuple[float, dict[int, float]]]] = field(default_factory=dict)
    # req_id -> drafts the proposer offers for the next step (speculative decoding only).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Wall time of the step on the runner, which policies learn step costs from.
    duration_s: float = 0.0
    # req_id -> why: requests whose own sampling raised; they end with an error, alone.
    failed: dict[str, str] = field(default_factory=dict)
    # Parts of it, for --profile-steps: the model forward (with the LM head) and sampling.
    forward_s: float = 0.0
    sample_s: float = 0.0


@dataclass(slots=True)
class RequestOutput:
    """One request's delta after a step: new tokens, and why it finished if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None
    # Usage so far, so a consumer needs no access to the (possibly finished) request.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # The request's speculative-decoding counters (a live reference; read them at the end).
    spec_stats: SpecDecodeStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
