"""Collects one step's decisions and turns them into a SchedulerOutput."""

from __future__ import annotations

from scheduling.output import CachedRequestData, NewRequestData, SchedulerOutput, TenantTokens
from scheduling.request import Request


class StepBuilder:
    """The token budget of one step and what has been scheduled against it so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_tokens = 0
        self.new: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []
        self.scheduled: list[tuple[Request, int]] = []

    def add_new(self, req: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.new.append(
            NewRequestData(
                req_id=req.request_id,
                token_ids=list(req.all_token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=req.num_computed_tokens,
                grammar=req.grammar,
                lora=req.lora,
            )
        )
        self._take(req, num_tokens)

    def add_cached(self, req: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        self.cached.append(
            CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
        )
        self._take(req, num_tokens)

    def _take(self, req: Request, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.budget
        self.budget -= num_tokens
        self.num_tokens += num_tokens
        self.scheduled.append((req, num_tokens))

    def build(self, finished: set[str], preempted: set[str]) -> SchedulerOutput:
        """Freeze the step and advance each request's progress counter.

        NOTE: `num_computed_tokens` moves forward at schedule time, not when the step ends,
        so the next step can be scheduled while this one still runs (the batch queue).
        """
        out = SchedulerOutput(
            scheduled_new_reqs=self.new,
            scheduled_cached_reqs=self.cached,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )
        shape = out.shape
        for req, n in self.scheduled:
            out.num_scheduled_tokens[req.request_id] = n
            # Known tokens: real ones plus those still being sampled by steps in flight.
            known = req.num_tokens + req.num_output_placeholders
            num_spec = max(0, req.num_computed_tokens + n - known)
            if num_spec:
                out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_spec]
            tenant = shape.tenant_tokens.get(req.tenant)
            if tenant is None:
                tenant = shape.tenant_tokens[req.tenant] = TenantTokens()
            klass = shape.priority_tokens.get(req.priority)
            if klass is None:
                klass = shape.priority_tokens[req.priority] = TenantTokens()
            if req.num_computed_tokens >= known - 1:
                shape.num_decode_tokens += n
                tenant.decode += n
                klass.decode += n
            else:
                shape.num_prefill_tokens += n
                tenant.prefill += n
                klass.prefill += n
            shape.num_context_tokens += req.num_computed_tokens + n
            req.num_computed_tokens += n
            if req.num_computed_tokens >= known:
                req.num_output_placeholders += 1
                out.sampling_req_ids.add(req.request_id)
        shape.num_seqs = len(self.scheduled)
        out.total_num_scheduled_tokens = shape.num_prefill_tokens + shape.num_decode_tokens
        return out
