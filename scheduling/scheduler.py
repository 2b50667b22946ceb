"""The unified-budget scheduler: no prefill phase, no decode phase.

Each step has `max_num_batched_tokens` tokens and `max_num_seqs` sequences to hand out.
Every request wants `num_tokens_with_spec - num_computed_tokens` more tokens: a prompt
chunk, one decode token, or 1 + k drafts. Running and waiting requests are merged in
policy order (ties go to running ones); a running request that runs out of KV blocks
preempts the lowest-ranked unscheduled running request (or itself), and a waiting request
ranked above a running one may preempt it to get in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kvcache import KVCacheManager
from kvcache.block import KVCacheBlock
from kvcache.connectors import KVConnectorScheduler
from scheduling.config import SchedulerConfig
from scheduling.kv_loads import KVLoads
from scheduling.output import RequestOutput, RunnerOutput, SchedulerOutput, StepStats
from scheduling.policy import Decision, LoadView, Policy
from scheduling.request import Request, RequestStatus
from scheduling.spec_stats import SpecDecodeStats
from scheduling.step_builder import StepBuilder
from scheduling.step_cap import StepCap
from scheduling.step_undo import can_undo, undo_step


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests already (the API answers 429)."""


class Scheduler:
    """Owns the waiting and running queues and every request's KV blocks.

    Public surface: `add_request`, `finish_requests`, `schedule`, `update`, `observe_step`.
    One owner: only the engine loop calls these; nothing else touches request state.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: Policy,
        clock: Callable[[], float] = time.monotonic,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.clock = clock
        # A request can never hold more tokens than the whole pool.
        self.max_model_len = min(config.max_model_len, kv.num_blocks * kv.block_size)
        self.watermark_blocks = int(config.watermark * kv.num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self._pending_outputs: list[RequestOutput] = []
        # Prompt KV from a KV connector (disk tier, a P/D producer); inert without one.
        self.kv_loads = KVLoads(kv_connector, kv)
        # The last step scheduled and the blocks its schedule registered in the prefix
        # cache: what `undo` needs to take it back.
        self._last_step: tuple[SchedulerOutput, list[KVCacheBlock]] | None = None
        self.num_undone_steps = 0

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue `req`; raises ValueError (bad request) or QueueFullError (try later)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt: {req.num_prompt_tokens} tokens leave no room to generate; "
                f"max_model_len is {self.max_model_len}"
            )
        if self.config.max_waiting and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def kv_loads_landed(self, done: dict[str, int]) -> list[str]:
        """The KV connector's runner side filled these loads (req id -> leading blocks ready);
        returns the ids still wanted (the others ended meanwhile)."""
        return self.kv_loads.land(done)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Never blocks, never calls the runner."""
        now = self.clock()
        registered: list[KVCacheBlock] = []
        self.kv.registered = registered if self.kv.enable_prefix_caching else None
        step = StepBuilder(self.config.max_num_batched_tokens)
        waiting = self._admissible_waiting(now)
        candidates = [*self.running, *waiting]
        begin_step = getattr(self.policy, "begin_step", None)
        if begin_step is not None:  # optional: per-step state computed once, before ranking
            begin_step(now, candidates)
        ranks = {r.request_id: self.policy.rank(r, now) for r in candidates}
        running = sorted(self.running, key=lambda r: ranks[r.request_id])
        waiting.sort(key=lambda r: ranks[r.request_id])
        ri = wi = 0
        admit_more = True
        urgent_step = False
        capped = StepCap(self.policy, now)
        while step.budget > 0:
            r = running[ri] if ri < len(running) else None
            w = waiting[wi] if admit_more and wi < len(waiting) else None
            take_waiting = w is not None and (
                r is None or ranks[w.request_id] < ranks[r.request_id]
            )
            nxt = w if take_waiting else r
            if nxt is None or (urgent_step and not take_waiting):
                # The step of an urgent first prefill carries nothing ranked below it: the
                # decodes and chunks it jumped wait one step, so its first token comes as
                # fast as on an idle engine (the policy asks for this: urgent_prefill_alone).
                break
            room = capped.room(nxt, step, take_waiting and not self.config.enable_chunked_prefill)
            if room <= 0:
                break  # the policy's cap: everything ranked after waits for a later step
            before = step.num_tokens
            if take_waiting:
                wi += 1
                # Head-of-line in policy order: if the best waiting request does not fit,
                # nothing ranked after it jumps ahead.
                admit_more = self._admit(
                    w, ranks[w.request_id], running, ri, ranks, step, now, room
                )
                urgent_step |= r is not None and self._isolates(w)
            else:
                ri += 1
                # vLLM's rule: a step that had to preempt admits nothing new.
                admit_more &= self._schedule_running(r, running, ri, step, room)
            capped.took(step.num_tokens - before)
        out = step.build(self._finished_ids, self._preempted_ids)
        out.kv_connector_meta = self.kv_loads.build_meta(step.scheduled)
        self._finished_ids, self._preempted_ids = set(), set()
        self._last_step = (out, registered)
        return out

    def interrupts(self, so: SchedulerOutput, request_id: str) -> bool:
        """Whether the step `so`, still running, should stop for `request_id`, which has
        just arrived: the policy asks for it (its optional `interrupts`) and `so` is the
        last step scheduled and can be taken back whole (scheduling/step_undo.py)."""
        decide = getattr(self.policy, "interrupts", None)
        req = self.requests.get(request_id)
        if decide is None or req is None or req.status != RequestStatus.WAITING:
            return False
        step = [self.requests[r] for r in so.num_scheduled_tokens if r in self.requests]
        return bool(step) and decide(req, step) and self.can_undo(so)

    def can_undo(self, so: SchedulerOutput) -> bool:
        """Whether `so` is the last step scheduled and `undo` can take it back whole."""
        last = self._last_step
        return last is not None and last[0] is so and can_undo(so, self.kv, last[1])

    def undo(self, so: SchedulerOutput) -> None:
        """Take back the last step scheduled, which stopped before it ended: its requests'
        progress and placeholders, and the prefix-cache entries its schedule made."""
        last = self._last_step
        if last is None or last[0] is not so:
            raise RuntimeError("undo: only the last step scheduled can be taken back")
        undo_step(so, self.requests, self.kv, last[1])
        self._last_step = None
        self.num_undone_steps += 1

    def _schedule_running(
        self, req: Request, running: list[Request], ri: int, step: StepBuilder, room: int
    ) -> bool:
        """Give `req` its tokens, preempting from the unscheduled tail; False if it preempted."""
        num_tokens = self._num_tokens_wanted(req, room)
        if num_tokens <= 0:
            return True
        # Drafts ride as lookahead: their slots are reserved but never prefix-cached, and
        # when blocks run short they are dropped before anyone is preempted.
        known = req.num_tokens + req.num_output_placeholders
        num_drafts = max(0, req.num_computed_tokens + num_tokens - known)
        preempted = False
        while (
            new_blocks := self.kv.allocate_slots(
                req,
                num_tokens - num_drafts,
                num_lookahead_tokens=num_drafts + self.config.num_lookahead_tokens,
            )
        ) is None:
            if num_drafts:
                fit = min(num_drafts - 1, max(0, self._free_slots(req) - num_tokens + num_drafts))
                num_tokens -= num_drafts - fit
                num_drafts = fit
                continue
            preempted = True
            if len(running) > ri:
                self._preempt(running.pop())
            else:
                self._preempt(req)
                return False
        step.add_cached(req, num_tokens, [b.block_id for b in new_blocks])
        return not preempted

    def _admit(
        self,
        req: Request,
        rank: Any,
        running: list[Request],
        ri: int,
        ranks: dict[str, Any],
        step: StepBuilder,
        now: float,
        room: int,
    ) -> bool:
        """Move `req` into the running set if it fits, preempting lower-ranked running ones;
        it gets at most `room` tokens this step."""
        if not self._lora_slot_free(req):
            return True  # it waits for an adapter slot; others may still get in

        def preempt_lower() -> bool:
            if len(running) <= ri or not rank < ranks[running[-1].request_id]:
                return False
            self._preempt(running.pop())
            return True

        while len(self.running) >= self.config.max_num_seqs:
            if not preempt_lower():
                return False
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        reserve = self.watermark_blocks if self.running else 0
        if self.kv_loads.try_start(req, hits, num_hit_tokens, reserve):
            return True  # it waits for its KV without budget; the others go on
        num_tokens = self._num_tokens_wanted(req, room, num_hit_tokens)
        num_computed = req.num_computed_tokens + num_hit_tokens
        if not self.config.enable_chunked_prefill and num_tokens < req.num_tokens - num_computed:
            return False
        while (
            self.kv.allocate_slots(
                req,
                num_tokens,
                hits,
                self.config.num_lookahead_tokens,
                reserve_blocks=reserve,
            )
            is None
        ):
            if not preempt_lower():
                return False
        # Tokens a KV connector supplied count as cached too.
        self.kv.prefix_stats.record(req.num_tokens, num_computed)
        self.kv_loads.admitted(req)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
            req.first_scheduled_time = now
        step.add_new(req, num_tokens, self.kv.get_block_ids(req.request_id))
        return True

    def _lora_slot_free(self, req: Request) -> bool:
        """Whether `req`'s adapter is running already or one of `max_loras` slots is free."""
        limit = self.config.max_loras
        if req.lora_id is None or not limit:
            return True
        running = {r.lora_id for r in self.running if r.lora_id is not None}
        return req.lora_id in running or len(running) < limit

    def _isolates(self, req: Request) -> bool:
        """Did admitting `req` (ranked above running requests) make this an urgent step?"""
        return (
            req.status == RequestStatus.RUNNING
            and getattr(self.policy, "urgent_prefill_alone", False)
            and req.num_preemptions == 0
            and not req.output_token_ids
        )

    def _free_slots(self, req: Request) -> int:
        """Token slots `req` could still use: its blocks' room plus every free block."""
        num_blocks = len(self.kv.get_block_ids(req.request_id)) + self.kv.num_free_blocks
        return (
            num_blocks * self.kv.block_size
            - req.num_computed_tokens
            - self.config.num_lookahead_tokens
        )

    def _num_tokens_wanted(self, req: Request, budget: int, num_hit_tokens: int = 0) -> int:
        wanted = req.num_tokens_with_spec - req.num_computed_tokens - num_hit_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            wanted = min(wanted, threshold)
        return min(wanted, budget)

    def _admissible_waiting(self, now: float) -> list[Request]:
        """Waiting requests the policy admits this step; rejected ones are finished here."""
        load = self.load_view()
        out = []
        for req in list(self.waiting):
            if req.status in (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_KV):
                continue
            admission = self.policy.admit(req, load, now)
            if admission.decision is Decision.REJECT:
                self._finish(req, RequestStatus.FINISHED_REJECTED, admission.reason)
                self._pending_outputs.append(
                    RequestOutput(
                        req.request_id,
                        [],
                        "rejected",
                        admission.reason,
                        None,
                        req.num_prompt_tokens,
                    )
                )
            elif admission.decision is Decision.ACCEPT:
                out.append(req)
        return out

    def _preempt(self, req: Request) -> None:
        """Evict `req` for recompute: blocks freed, progress reset, back to the waiting front."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        # A step in flight may still return its token; it is appended then, as a real one.
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)
        self._preempted_ids.add(req.request_id)

    # -- results -------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestOutput]:
        """Apply a finished step's sampled tokens; return each request's delta."""
        now = self.clock()
        outputs, self._pending_outputs = self._pending_outputs, []
        for req_id in output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None:
                continue  # finished or aborted meanwhile
            if req_id in output.sampling_req_ids and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            sampled = runner_output.sampled_token_ids.get(req_id)
            if not sampled:
                continue  # a prompt chunk short of the end
            drafts = output.scheduled_spec_decode_tokens.get(req_id, ())
            # Rejected drafts wrote KV that must be overwritten: step the counter back.
            req.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            req.spec_token_ids = []
            if drafts:
                self._record_verified(req, len(drafts), len(sampled) - 1)
            new_ids: list[int] = []
            status = None
            for token_id in sampled:
                req.append_output_token(token_id, now)
                new_ids.append(token_id)
                if (status := req.check_stop(self.max_model_len)) is not None:
                    self._finish(req, status)
                    break
            if status is None and req_id in runner_output.draft_token_ids:
                req.set_drafts(runner_output.draft_token_ids[req_id], self.max_model_len)
                self.spec_stats.num_proposed += len(req.spec_token_ids)
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(
                RequestOutput(
                    req_id,
                    new_ids,
                    status.finish_reason if status else None,
                    req.stop_reason,
                    logprobs[: len(new_ids)] if logprobs else None,
                    req.num_prompt_tokens,
                    req.num_output_tokens,
                    max(0, req.num_cached_tokens),
                    req.spec_stats,
                )
            )
        return outputs

    def _record_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        req.spec_stats.record_verified(num_drafts, num_accepted)
        self.spec_stats.record_verified(num_drafts, num_accepted)

    def observe_step(self, stats: StepStats) -> None:
        """Tell the policy how long a step took (the SLO policy learns its cost model)."""
        self.policy.observe(stats)

    def _finish(self, req: Request, status: RequestStatus, reason: str | None = None) -> None:
        """The one place a request leaves the scheduler and its blocks go back."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.num_output_placeholders = 0
        req.finish_time = self.clock()
        if reason is not None:
            req.stop_reason = reason
        self.kv.free(req, trusted=status != RequestStatus.FINISHED_ERROR)
        self.kv_loads.finished(req)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)

    # -- views ---------------------------------------------------------------------------

    def load_view(self) -> LoadView:
        return LoadView(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in self.waiting),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
        )

    def check_integrity(self) -> None:
        """KV invariants, plus: queues and the request map agree; only running hold blocks."""
        self.kv.check_integrity()
        assert len(self.running) <= self.config.max_num_seqs
        ids = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert ids == set(self.requests), "queues and request map disagree"
        assert len(ids) == len(self.running) + len(self.waiting), "request queued twice"
        holders = self.kv_loads.holders()
        for req in self.waiting:
            if req.request_id not in holders:
                assert not self.kv.req_to_blocks.get(req.request_id), "waiting request holds blocks"
        assert set(self.kv.req_to_blocks) <= {r.request_id for r in self.running} | holders
