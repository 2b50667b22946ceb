"""Engine: Scheduler + KVCacheManager + ModelRunner + detokenizer, stepped in one thread.

`Engine.generate` serves scripts; `AsyncEngine` (daemon/engine/async_engine.py) drives the
same three calls (schedule, execute, process) from the event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence

import torch

from daemon.engine import kv_connector as kv_connectors
from daemon.engine import offline, speculative
from daemon.engine.admission import check_prompt, check_vocab
from daemon.engine.client import AdapterInfo, EngineStats, ModelInfo
from daemon.engine.config import EngineConfig
from daemon.engine.grammar_requests import GrammarRequests
from daemon.engine.kv_sizing import num_kv_blocks, uses_cuda_graphs
from daemon.engine.loaded_model import LoadedModel
from daemon.engine.lora import adapter_info, lora_enabled, setup_lora
from daemon.engine.output_processor import OutputProcessor
from daemon.engine.outputs import Completion, Delta
from daemon.engine.setup import describe, make_policy, thread_governor, tp_cache_spec
from daemon.engine.stats import engine_stats
from grammars import GrammarSpec
from grammars.limits import GrammarLimits
from kvcache import KVCacheManager
from runner import kv_format
from runner.device_queue import PendingOutput
from runner.lora import LoRARegistry, UnknownAdapterError
from runner.model_runner import ModelRunner
from scheduling import (
    DEFAULT_TENANT,
    SLO,
    Request,
    RequestOutput,
    RequestStatus,
    RunnerOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepStats,
)

log = logging.getLogger("headrace.engine")


class Engine:
    """The whole data plane in one object; not thread-safe (one owner calls it)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        record_kv_events: bool = False,
    ):
        self.config = config = config or EngineConfig()
        self.governor = thread_governor(config)
        # Whether a running step may be stopped for an urgent arrival (enable_step_stops).
        self.stops_steps = False
        loaded = loaded or LoadedModel.load(config)
        self.device, self.dtype = loaded.device, loaded.dtype
        # The KV cache's rows: the model's dtype, or int8 (runner/kv_format.py).
        int8_auto = loaded.platform is not None and loaded.platform.int8_kv
        self.kv_dtype = kv_format.cache_dtype(config.kv_cache_dtype, self.dtype, int8_auto)
        self.tokenizer, self.model, self.model_config = (
            loaded.tokenizer,
            loaded.model,
            loaded.config,
        )
        self.model_name = loaded.name
        # Tensor parallelism: the workers' handle (None with one rank).
        self.tp_driver = loaded.tp_driver
        max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, 8192)
        # The adapters served by name; None when LoRA is off (nothing installed). Set up
        # before the KV cache is sized: the resident slots take device memory too.
        self.loras: LoRARegistry | None = None
        lora_manager = None
        if lora_enabled(config):
            self.loras, lora_manager = setup_lora(
                self.model, self.model_config, self.model_name, config, self.device, self.dtype
            )
        num_blocks = num_kv_blocks(
            config, self.model, self.model_config, self.device, self.dtype, self.kv_dtype,
            max_model_len,
        )  # fmt: skip
        # A data-parallel replica records KV events for the front door's router mirror.
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_cache_hash,
            record_events=record_kv_events,
        )
        sched_config = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_waiting=config.max_waiting,
            max_loras=config.max_loras if self.loras is not None else 0,
        )
        self.kv_connector = kv_connectors.build_kv_connector(
            config, self.model, self.model_config, self.kv_dtype, self.device
        )
        self.scheduler = Scheduler(
            sched_config,
            self.kv,
            make_policy(config),
            kv_connector=self.kv_connector.scheduler if self.kv_connector else None,
        )
        # (tenant, seconds from arrival to first scheduled) of requests admitted since the
        # last /metrics scrape, which drains it; bounded so nobody scraping costs nothing.
        self.queue_times: deque[tuple[str, float]] = deque(maxlen=4096)
        self.speculative = speculative.speculative_config(config)
        graphs = uses_cuda_graphs(config, self.device)
        self.runner = ModelRunner(
            self.model,
            self.model_config,
            num_blocks,
            config.block_size,
            self.device,
            self.kv_dtype,
            config.attention_backend,
            (config.max_num_seqs, max_model_len) if graphs else None,
            speculative.build_proposer(self.speculative),
            self.speculative.num_speculative_tokens,
            lora_manager,
            self.kv_connector.worker if self.kv_connector else None,
            self.tp_driver,
        )
        self.runner.draft_length = speculative.draft_length(self.speculative)
        if config.deterministic:
            from runner.batch_invariance import make_attention_batch_invariant

            make_attention_batch_invariant(self.runner.attn_backend)
        if self.tp_driver is not None:
            self.tp_driver.send_cache(tp_cache_spec(self, num_blocks, loaded))
        self.eos_token_id = (self.model_config.eos_token_ids or [None])[0]
        self.info = ModelInfo(
            self.model_name,
            max_model_len,
            self.model_config.vocab_size,
            config.max_waiting or 0,
            self.eos_token_id or 0,
            config.enable_lora_runtime_updates,
        )
        self.outputs = OutputProcessor()
        self._ids = itertools.count()
        # Deltas made outside a step (a grammar that failed), handed out with the next one.
        self._pending: list[Delta] = []
        # Compiles grammars off this thread; constrained requests wait for them here.
        self.grammars = GrammarRequests(
            self.tokenizer,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            GrammarLimits(config.grammar_max_bytes, config.grammar_max_choices),
            int(config.grammar_cache_mb * (1 << 20)),
            config.grammar_compile_timeout,
            config.grammar_workers,
        )
        log.info("%s", describe(self))

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
        lora: str | None = None,
        tenant: str = DEFAULT_TENANT,
        client: str = "",
        kv_source: str | None = None,
    ) -> str:
        """Queue a request; with `grammar` it waits in WAITING_FOR_GRAMMAR until compiled.
        `lora` names a served adapter (UnknownAdapterError if there is none of that name).
        `client` (the tenant, or a peer address) is whose fair share of the grammar
        compilers the compile waits for (default: the tenant). `kv_source`: where the KV
        connector loads the prompt's KV from (a P/D consumer: its producer's KV address)."""
        params = params or SamplingParams()
        adapter = None
        if lora is not None:
            if self.loras is None:
                raise UnknownAdapterError(f"the model {lora!r} does not exist")
            adapter = self.loras.get(lora)
        if grammar is not None and params.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with structured output")
        prompt_ids = self.tokenize(prompt)
        check_prompt(prompt_ids, self.model_config.vocab_size)
        check_vocab(params, self.model_config.vocab_size)
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
            lora_id=adapter.lora_id if adapter else None,
            lora=adapter,
            tenant=tenant,
            kv_source=kv_source,
        )
        if grammar is not None:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(req)
        if grammar is not None:
            self.grammars.submit(req, grammar, client or tenant)
        self.outputs.add(request_id, self.tokenizer, prompt_ids, params)
        return request_id

    def adapters(self) -> list[AdapterInfo]:
        return [adapter_info(a) for a in self.loras or ()]

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.grammars.forget(request_ids)
        self.outputs.drop(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step: schedule (loop thread) -> execute (runner thread) -> process (loop) ----

    def schedule(self) -> SchedulerOutput:
        """Release requests whose grammar is ready (or failed), then schedule a step."""
        for req, error in self.grammars.poll():
            delta = self._end_with_error(req.request_id, error)
            delta.bad_request, delta.num_prompt_tokens = error, req.num_prompt_tokens
            self._pending.append(delta)
        kv_connectors.land_loads(self.kv_connector, self.scheduler)
        so = self.scheduler.schedule()
        kv_connectors.start_loads(self.kv_connector, so)
        for new in so.scheduled_new_reqs:
            req = self.scheduler.requests[new.req_id]
            if req.num_preemptions == 0 and req.first_scheduled_time is not None:
                self.queue_times.append((req.tenant, req.first_scheduled_time - req.arrival_time))
        return so

    def step(self) -> list[Delta]:
        so = self.schedule()
        kv_connectors.wait_for_loads(self.kv_connector, so)
        return self.process(so, self.execute(so))

    def needs_runner(self) -> bool:
        """Whether an empty step has work on the runner: fetched KV to copy in."""
        return kv_connectors.needs_runner(self.kv_connector)

    def close(self) -> None:
        """Finish the KV connector's writes and stop its threads (a producer's server too);
        stop the tensor-parallel workers."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if self.tp_driver is not None:
            self.tp_driver.close()

    @property
    def fatal(self) -> str | None:
        """Why this engine can run no more steps (a tensor-parallel rank was lost), or None."""
        return self.tp_driver.failure if self.tp_driver is not None else None

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

    def interrupt_for(self, so: SchedulerOutput, request_id: str) -> bool:
        """Ask the running step `so` to stop between layers for `request_id`, which has
        just arrived, when the policy wants it and the step can be taken back (CPU runner,
        no KV connector). True if asked; the step then raises StepInterrupted and the loop
        calls `undo_step`."""
        stop = getattr(self.runner, "interrupt", None)
        if stop is None or not self.stops_steps:
            return False
        if not self.scheduler.interrupts(so, request_id):
            return False
        stop.request()
        return True

    def enable_step_stops(self) -> bool:
        """The loop runs one step at a time, so a running step may be stopped for an
        urgent arrival (`interrupt_for`) where the runner can (a CPU runner without tensor
        parallelism or speculation) and no KV connector moves the step's KV. Returns
        whether steps will stop."""
        self.stops_steps = (
            getattr(self.runner, "interrupt", None) is not None and self.kv_connector is None
        )
        return self.stops_steps

    def arm_interrupt(self) -> None:
        """Called before each step starts: a stop asked for an earlier step (which ended
        first) must not reach this one."""
        stop = getattr(self.runner, "interrupt", None)
        if stop is not None:
            stop.clear()

    def undo_step(self, so: SchedulerOutput) -> None:
        """`so` stopped before it ended (StepInterrupted): take it back; its requests run
        again from where they were."""
        self.scheduler.undo(so)

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
        self.outputs.drop([rid])
        return Delta.ending(rid, "error", why)

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
        self.outputs.drop(ids)
        return [Delta.ending(rid, "error", str(error)) for rid in ids]

    def _delta(self, out: RequestOutput) -> Delta:
        delta, stop_here = self.outputs.delta(out)
        if stop_here:
            self.scheduler.finish_requests([out.request_id], RequestStatus.FINISHED_STOPPED)
        if not self.speculative.enabled:
            delta.spec_stats = None
        return delta

    def stats(self) -> EngineStats:
        """Load and cache figures now (loop thread: it reads scheduler state)."""
        return engine_stats(self)

    # -- scripts -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        grammars: Sequence[GrammarSpec | None] | None = None,
        loras: Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Run `prompts` to completion together; results in prompt order (daemon/engine/
        offline.py). `params`, `grammars` and `loras` may be one per prompt."""
        return offline.generate(self, prompts, params, grammars, loras)
