"""Engine: Scheduler + KVCacheManager + ModelRunner + detokenizer, stepped in one thread.

`Engine.generate` serves scripts; `AsyncEngine` (daemon/async_engine.py) drives the same
three calls (schedule, execute, process) from the event loop.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from daemon.detokenizer import IncrementalDetokenizer
from daemon.engine_config import EngineConfig, default_threads
from daemon.grammar_requests import GrammarRequests
from daemon.loaded_model import LoadedModel, pick_device
from daemon.validation import check_vocab
from grammars import GrammarSpec
from kvcache import KVCacheManager
from plugins import load_policy, load_proposer
from runner.device_queue import PendingOutput
from runner.model_runner import ModelRunner, kv_bytes_per_block
from runner.spec_decode import SpeculativeConfig
from runner.spec_decode.draft_length import AdaptiveDraftLength
from runner.thread_governor import ThreadGovernor
from scheduling import (
    SLO,
    Request,
    RequestOutput,
    RequestStatus,
    RunnerOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SpecDecodeStats,
    StepStats,
)

log = logging.getLogger("headrace.engine")


@dataclass(slots=True)
class Delta:
    """What one request gained in one step: text and ids, and its end if it ended."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Set when the request was bad in a way found only inside the engine (its grammar does
    # not compile): the API answers 400 with this message.
    bad_request: str | None = None
    # Speculative-decoding counters of the request so far (None without speculation).
    spec_stats: SpecDecodeStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


class Engine:
    """The whole data plane in one object; not thread-safe (one owner calls it)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        self.governor: ThreadGovernor | None = None
        if config.threads or pick_device(config.device).type == "cpu":
            threads = config.threads or default_threads()
            torch.set_num_threads(threads)
            governor = ThreadGovernor(threads)
            # A PASSIVE team sleeps instead of spinning: it never waits on a lost core.
            passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
            if config.thread_governor and governor.enabled and not passive:
                self.governor = governor
        loaded = loaded or LoadedModel.load(config)
        self.device, self.dtype = loaded.device, loaded.dtype
        self.tokenizer, self.model, self.model_config = (
            loaded.tokenizer,
            loaded.model,
            loaded.config,
        )
        self.model_name = loaded.name
        max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, 8192)
        num_blocks = self._num_kv_blocks(max_model_len)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, config.prefix_cache_hash
        )
        sched_config = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_waiting=config.max_waiting,
        )
        self.scheduler = Scheduler(sched_config, self.kv, load_policy(config.policy))
        self.speculative = SpeculativeConfig(
            config.speculative_method,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.speculative_adaptive,
        )
        proposer = (
            load_proposer(self.speculative.method, self.speculative)
            if self.speculative.enabled
            else None
        )
        self.runner = ModelRunner(
            self.model,
            self.model_config,
            num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            config.attention_backend,
            None if self._eager() else (config.max_num_seqs, max_model_len),
            proposer,
            self.speculative.num_speculative_tokens,
        )
        if proposer is not None and self.speculative.adaptive:
            self.runner.draft_length = AdaptiveDraftLength(self.speculative.num_speculative_tokens)
        self.eos_token_id = (self.model_config.eos_token_ids or [None])[0]
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        # Deltas made outside a step (a grammar that failed), handed out with the next one.
        self._pending: list[Delta] = []
        # Compiles grammars off this thread; constrained requests wait for them here.
        self.grammars = GrammarRequests(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        log.info(
            "engine: %s (%s) on %s/%s, attention %s, %d KV blocks of %d tokens, %d threads "
            "(OMP_WAIT_POLICY=%s, thread governor %s), speculative %s",
            self.model_name,
            self.model_config.architecture,
            self.device,
            self.dtype,
            self.runner.attn_backend.name,
            num_blocks,
            config.block_size,
            torch.get_num_threads(),
            os.environ.get("OMP_WAIT_POLICY", "unset"),
            "on" if self.governor else "off",
            f"{self.speculative.method} k={self.speculative.num_speculative_tokens}"
            if self.speculative.enabled
            else "off",
        )

    def _eager(self) -> bool:
        """CUDA graphs need CUDA and the Triton backend; --enforce-eager turns them off."""
        from runner.triton_ops import triton_available

        if self.config.enforce_eager or self.device.type != "cuda":
            return True
        backend = self.config.attention_backend
        return not (backend == "triton" or (backend == "auto" and triton_available()))

    def _num_kv_blocks(self, max_model_len: int) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
                if not self._eager():
                    budget -= self._graph_memory(max_model_len)
            else:
                budget = min(_available_ram() // 4, 1 << 30)
        if budget < per_block:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes holds no block ({per_block} bytes per block)"
            )
        return budget // per_block

    def _graph_memory(self, max_model_len: int) -> int:
        """The decode graphs' pool, measured on a throwaway cache before the real one exists."""
        from runner.attention_backends import select_attention_backend
        from runner.cuda_graphs import estimate_graph_memory

        cfg = self.model_config
        backend = select_attention_backend(
            self.device, cfg.num_key_value_heads, self.config.attention_backend
        )
        self.model.set_attention_backend(backend)
        shape = (2, 1, self.config.block_size, cfg.num_key_value_heads, cfg.head_dim)
        return estimate_graph_memory(
            self.model, shape, self.dtype, self.config.max_num_seqs, max_model_len, self.device
        )

    # -- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        slo: SLO | None = None,
        cache_salt: str | None = None,
        grammar: GrammarSpec | None = None,
    ) -> str:
        """Queue a request; with `grammar` it waits in WAITING_FOR_GRAMMAR until compiled."""
        params = params or SamplingParams()
        if grammar is not None and params.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with structured output")
        prompt_ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        check_vocab(params, vocab)
        request_id = request_id or f"req-{next(self._ids)}"
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=time.monotonic(),
            eos_token_id=self.eos_token_id,
            priority=priority,
            slo=slo,
            cache_salt=cache_salt,
        )
        if grammar is not None:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(req)
        if grammar is not None:
            self.grammars.submit(req, grammar)
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
        return request_id

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self._detokenizers.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step: schedule (loop thread) -> execute (runner thread) -> process (loop) ----

    def schedule(self) -> SchedulerOutput:
        """Release requests whose grammar is ready (or failed), then schedule a step."""
        for req, error in self.grammars.poll():
            delta = self._end_with_error(req.request_id, error)
            delta.bad_request, delta.prompt_tokens = error, req.num_prompt_tokens
            self._pending.append(delta)
        return self.scheduler.schedule()

    def step(self) -> list[Delta]:
        so = self.schedule()
        return self.process(so, self.execute(so))

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        ro = self.launch(so)
        return ro.result() if isinstance(ro, PendingOutput) else ro

    def launch(self, so: SchedulerOutput) -> RunnerOutput | PendingOutput:
        """Run a step; on CUDA its ids may still be on their way (PendingOutput.result())."""
        start = time.perf_counter()
        governor = self.governor if not so.is_empty else None
        if governor is not None:
            self._set_threads(governor.threads())
        try:
            ro = self.runner.execute(so)
        finally:
            if governor is not None:
                governor.step_done()
        if isinstance(ro, RunnerOutput):
            ro.duration_s = time.perf_counter() - start
        return ro

    def _set_threads(self, threads: int) -> None:
        """The governor's thread count, set on this (the runner's) thread when it changes."""
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            assert self.governor is not None
            log.info("thread governor: %d thread(s) from now (%s)", threads, self.governor.reason)

    def process(self, so: SchedulerOutput, ro: RunnerOutput) -> list[Delta]:
        """Apply a step's results: advance requests, detokenize, end those that hit a stop."""
        if not so.is_empty:
            self.scheduler.observe_step(StepStats(so.shape, ro.duration_s))
        deltas, self._pending = self._pending, []
        deltas += self._fail_requests(ro.failed)
        for out in self.scheduler.update(so, ro):
            deltas.append(self._delta_isolated(out))
        return deltas

    def _fail_requests(self, failed: dict[str, str]) -> list[Delta]:
        """End requests whose own processing raised (finish "error"); the others go on."""
        ids = [rid for rid in failed if rid in self.scheduler.requests]
        if not ids:
            return []
        log.error("ending %d request(s) after a fault of their own: %s", len(ids), failed)
        return [self._end_with_error(rid, failed[rid]) for rid in ids]

    def _end_with_error(self, rid: str, why: str) -> Delta:
        """Finish one request FINISHED_ERROR (its blocks freed untrusted) and say why."""
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
        self._detokenizers.pop(rid, None)
        return Delta(rid, "", [], "error", why)

    def _delta_isolated(self, out: RequestOutput) -> Delta:
        """`_delta`, but a detokenizer (or stop-check) fault ends this request alone."""
        try:
            return self._delta(out)
        except Exception as e:  # attributable to this request only
            log.error("detokenizing %s failed", out.request_id, exc_info=True)
            return self._end_with_error(out.request_id, f"detokenizing failed: {e!r}")

    def release_finished(self) -> None:
        """When idle: let the runner drop the state of requests that ended in the last step.

        Those ids normally ride on the next SchedulerOutput; with no next step they would
        linger. Call only while no step is in flight (it runs on the caller's thread).
        """
        so = self.schedule()
        assert so.is_empty, "release_finished called with runnable requests"
        self.runner.execute(so)

    def check_idle(self) -> bool:
        """With no request left, every block must be free and the pool consistent.

        Cheap (one pass over the blocks); the loop calls it each time it goes idle, so a leak
        shows up in the log at once instead of as a slowly shrinking cache.
        """
        try:
            self.kv.check_integrity()
            assert self.kv.num_free_blocks == self.kv.num_blocks, (
                f"{self.kv.num_blocks - self.kv.num_free_blocks} KV blocks held while idle"
            )
        except AssertionError as e:
            log.error("KV cache check failed while idle: %s", e)
            return False
        return True

    def fail_step(self, so: SchedulerOutput, error: BaseException) -> list[Delta]:
        """A step raised: its requests end with finish_reason "error"; the engine goes on."""
        log.exception("step failed; ending its %d requests", len(so.num_scheduled_tokens))
        ids = [rid for rid in so.num_scheduled_tokens if rid in self.scheduler.requests]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        for rid in ids:
            self._detokenizers.pop(rid, None)
        return [Delta(rid, "", [], "error", str(error)) for rid in ids]

    def _delta(self, out: RequestOutput) -> Delta:
        detok = self._detokenizers.get(out.request_id)
        text = detok.add(out.new_token_ids) if detok else ""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        token_ids, logprobs = out.new_token_ids, out.new_logprobs
        completion_tokens = out.num_output_tokens
        # Several tokens per step (speculation): a stop string completed before the last
        # token ends the request there, even if a later one was EOS or the length limit.
        stopped = detok is not None and detok.stop_reason is not None
        extra = len(token_ids) - detok.stop_token_count if stopped else 0  # type: ignore[union-attr]
        if stopped and (finish_reason is None or extra > 0):
            self.scheduler.finish_requests([out.request_id], RequestStatus.FINISHED_STOPPED)
            finish_reason, stop_reason = "stop", detok.stop_reason
            if extra > 0:
                token_ids = token_ids[:-extra]
                logprobs = logprobs[:-extra] if logprobs else logprobs
                completion_tokens -= extra
        if finish_reason is not None and detok is not None:
            text += detok.flush()
            self._detokenizers.pop(out.request_id, None)
        return Delta(
            out.request_id,
            text,
            token_ids,
            finish_reason,
            stop_reason,
            logprobs,
            out.num_prompt_tokens,
            completion_tokens,
            out.num_cached_tokens,
            spec_stats=out.spec_stats if self.speculative.enabled else None,
        )

    # -- scripts -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        grammars: Sequence[GrammarSpec | None] | None = None,
    ) -> list[Completion]:
        """Run `prompts` to completion together; results in prompt order.

        `params` and `grammars` may be one per prompt.
        """
        per_params = params if isinstance(params, Sequence) else [params] * len(prompts)
        per_grammar = grammars if grammars is not None else [None] * len(prompts)
        ids = [
            self.add_request(p, sp, grammar=g)
            for p, sp, g in zip(prompts, per_params, per_grammar, strict=True)
        ]
        results = {rid: Completion(rid) for rid in ids}
        # Offline, the batch starts together once its grammars are compiled: the steps
        # (and so the outputs) do not depend on how fast the compile threads were.
        self.grammars.wait_compiled()
        while self.has_unfinished_requests():
            for d in self.step():
                c = results.get(d.request_id)
                if c is None:
                    continue
                c.text += d.text
                c.token_ids += d.token_ids
                if d.finished:
                    c.finish_reason = d.finish_reason
                    c.error = d.bad_request
                    c.prompt_tokens, c.cached_tokens = d.prompt_tokens, d.cached_tokens
        self.release_finished()
        return [results[rid] for rid in ids]


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
