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
from typing import Any

import torch

from daemon.detokenizer import IncrementalDetokenizer
from daemon.engine_config import EngineConfig, default_threads
from kvcache import KVCacheManager
from plugins import load_model_class, load_policy
from runner.loader import load_model, open_checkpoint
from runner.model_config import ModelConfig
from runner.model_runner import ModelRunner, kv_bytes_per_block
from runner.model_source import resolve_model
from runner.models.decoder import DecoderForCausalLM
from runner.platform import Platform, select_platform
from runner.tokenizer import load_tokenizer
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


@dataclass(slots=True)
class LoadedModel:
    """Weights, shape and tokenizer of a model; engines can share one (weights are read-only)."""

    model: DecoderForCausalLM
    config: ModelConfig
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    platform: Platform | None = None

    @classmethod
    def load(cls, config: EngineConfig) -> LoadedModel:
        device = _pick_device(config.device)
        source = resolve_model(config.model)
        checkpoint = open_checkpoint(source)
        shape = checkpoint.config()
        platform = select_platform(
            device,
            config.dtype,
            config.quantization,
            checkpoint_quantized=checkpoint.is_quantized(),
            # The model's own MLP shape decides whether int8 pays off here.
            bench_shape=(2 * shape.intermediate_size, shape.hidden_size),
        )
        log.info("%s", platform.describe())
        t0 = time.perf_counter()
        model, model_config = load_model(
            source, device, platform.dtype, lookup=load_model_class, checkpoint=checkpoint
        )
        platform.prepare(model)
        tokenizer = load_tokenizer(source)
        log.info("loaded %s in %.1fs", source.name, time.perf_counter() - t0)
        return cls(model, model_config, tokenizer, source.name, device, platform.dtype, platform)


class Engine:
    """The whole data plane in one object; not thread-safe (one owner calls it)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.threads or _pick_device(config.device).type == "cpu":
            torch.set_num_threads(config.threads or default_threads())
        loaded = loaded or LoadedModel.load(config)
        self.device, self.dtype = loaded.device, loaded.dtype
        self.tokenizer, self.model, self.model_config = (
            loaded.tokenizer,
            loaded.model,
            loaded.config,
        )
        self.model_name = loaded.name
        max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, 8192)
        num_blocks = self._num_kv_blocks()
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
        self.runner = ModelRunner(
            self.model, self.model_config, num_blocks, config.block_size, self.device, self.dtype
        )
        self.eos_token_id = (self.model_config.eos_token_ids or [None])[0]
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        log.info(
            "engine: %s (%s) on %s/%s, %d KV blocks of %d tokens, %d threads (OMP_WAIT_POLICY=%s)",
            self.model_name,
            self.model_config.architecture,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
            torch.get_num_threads(),
            os.environ.get("OMP_WAIT_POLICY", "unset"),
        )

    def _num_kv_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = min(_available_ram() // 4, 1 << 30)
        if budget < per_block:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes holds no block ({per_block} bytes per block)"
            )
        return budget // per_block

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
    ) -> str:
        params = params or SamplingParams()
        prompt_ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
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
        self.scheduler.add_request(req)
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
        return request_id

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self._detokenizers.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step: schedule (loop thread) -> execute (runner thread) -> process (loop) ----

    def step(self) -> list[Delta]:
        so = self.scheduler.schedule()
        return self.process(so, self.execute(so))

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        ro = self.runner.execute(so)
        ro.duration_s = time.perf_counter() - start
        return ro

    def process(self, so: SchedulerOutput, ro: RunnerOutput) -> list[Delta]:
        """Apply a step's results: advance requests, detokenize, end those that hit a stop."""
        if not so.is_empty:
            self.scheduler.observe_step(StepStats(so.shape, ro.duration_s))
        deltas = []
        for out in self.scheduler.update(so, ro):
            deltas.append(self._delta(out))
        return deltas

    def release_finished(self) -> None:
        """When idle: let the runner drop the state of requests that ended in the last step.

        Those ids normally ride on the next SchedulerOutput; with no next step they would
        linger. Call only while no step is in flight (it runs on the caller's thread).
        """
        so = self.scheduler.schedule()
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
        if detok is not None and detok.stop_reason is not None and finish_reason is None:
            self.scheduler.finish_requests([out.request_id], RequestStatus.FINISHED_STOPPED)
            finish_reason, stop_reason = "stop", detok.stop_reason
        if finish_reason is not None and detok is not None:
            text += detok.flush()
            self._detokenizers.pop(out.request_id, None)
        return Delta(
            out.request_id,
            text,
            out.new_token_ids,
            finish_reason,
            stop_reason,
            out.new_logprobs,
            out.num_prompt_tokens,
            out.num_output_tokens,
            out.num_cached_tokens,
        )

    # -- scripts -------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run `prompts` to completion together; results in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        results = {rid: Completion(rid) for rid in ids}
        while self.has_unfinished_requests():
            for d in self.step():
                c = results.get(d.request_id)
                if c is None:
                    continue
                c.text += d.text
                c.token_ids += d.token_ids
                if d.finished:
                    c.finish_reason = d.finish_reason
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


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
