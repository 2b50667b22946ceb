"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It mirrors the scheduler's view of each running request (token ids, block table, progress)
from the deltas in SchedulerOutput, so it never calls back into the scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grammars import GrammarState, allocate_bitmask
from runner import kv_format
from runner.attention_backends import select_attention_backend
from runner.device_queue import DeviceTokens, PendingOutput, plain_greedy, to_device
from runner.fault_isolation import sample_isolated, sample_one_each
from runner.kv_connectors import KVConnectorWorker
from runner.lora import LoRAManager
from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM
from runner.parallel.step import StepInput
from runner.rejection_sampler import LogprobEntry, verify_drafts
from runner.sampler import SamplingBatch
from runner.spec_decode import DraftRequest, Proposer
from runner.spec_decode.draft_length import AdaptiveDraftLength
from runner.step_interrupt import StepInterrupt, StepInterrupted
from scheduling import NewRequestData, RunnerOutput, SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    from runner.parallel.driver import TensorParallelDriver

log = logging.getLogger("headrace.runner")


@dataclass(slots=True)
class RunnerRequest:
    """The runner's copy of one running request."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Its grammar matcher when constrained; advanced here, on the runner thread.
    grammar: GrammarState | None = None
    # Its LoRA adapter (runner/lora), None for the base model.
    lora: object | None = None


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers in a cache of `dtype` (int8: kv_format's rows)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = kv_format.row_width(cfg.head_dim, dtype)
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * row * itemsize


class ModelRunner:
    """Owns the model and the KV cache tensors; executes one step at a time."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype = torch.float32,
        attention_backend: str = "auto",
        decode_graphs: tuple[int, int] | None = None,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        lora: LoRAManager | None = None,
        kv_connector: KVConnectorWorker | None = None,
        tp_driver: TensorParallelDriver | None = None,
    ) -> None:
        """`kv_dtype`: the KV cache's, the model's dtype or torch.int8 (runner/kv_format.py).
        `decode_graphs` = (max_num_seqs, max_model_len) captures CUDA graphs for
        decode-only steps (CUDA with the Triton backend only; ignored elsewhere). `lora`
        serves adapters (its wrappers are installed on `model` already). `tp_driver`: the
        model is rank 0's shard; each step's input goes to the other ranks first."""
        self.model, self.cfg = model, cfg
        self.lora = lora
        # Speculative decoding: drafts proposed right after sampling, verified next step.
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer else 0
        # None: every request gets the full k each step.
        self.draft_length: AdaptiveDraftLength | None = None
        self.block_size, self.device = block_size, device
        self.tp_driver = tp_driver
        # This rank's KV heads (all of them without tensor parallelism).
        local = getattr(model, "local_config", cfg)
        self.kv_caches = kv_format.allocate(
            cfg.num_hidden_layers, num_blocks, block_size, local.num_key_value_heads,
            local.head_dim, kv_dtype, device,
        )  # fmt: skip
        self.attn_backend = select_attention_backend(
            device, local.num_key_value_heads, attention_backend
        )
        if hasattr(model, "set_attention_backend"):
            model.set_attention_backend(self.attn_backend)
        elif self.attn_backend.name != "torch":
            raise ValueError(f"{type(model).__name__} cannot take the {self.attn_backend.name} "
                             "attention backend (it has no set_attention_backend)")  # fmt: skip
        self.graphs = None
        if tp_driver is not None:  # the workers replay steps eagerly, ids from the host
            decode_graphs = None
        if decode_graphs and device.type == "cuda" and self.attn_backend.name == "triton":
            from runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv_caches, *decode_graphs, block_size, device)
            self.graphs.capture()
        # CUDA: greedy steps leave their ids on the GPU (runner/device_queue.py).
        self.device_tokens = DeviceTokens() if device.type == "cuda" and tp_driver is None else None
        # A CPU step may be stopped between layers (step_interrupt.py); not under tensor
        # parallelism (the workers would be left mid-collective) nor speculative decoding
        # (the drafter's state moves with each step), nor where the model has no such check.
        self.interrupt: StepInterrupt | None = None
        cpu_alone = device.type == "cpu" and tp_driver is None and proposer is None
        if cpu_alone and hasattr(model, "interrupt"):
            self.interrupt = model.interrupt = StepInterrupt()
        self.requests: dict[str, RunnerRequest] = {}
        # Seeded generators outlive preemption, so a resumed request continues its sequence.
        self.generators: dict[str, torch.Generator] = {}
        # Ids held back while a request is short of min_tokens (unless it ignores EOS).
        self.eos_ids = sorted(set(cfg.eos_token_ids))
        # Runner side of a KV connector: loads committed before the forward, saves after it.
        self.kv_connector = kv_connector
        self._block_tables = _BlockTables(self.requests)

    def _apply_deltas(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
            if self.draft_length is not None:
                self.draft_length.drop(rid)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        if self.kv_connector is not None and so.finished_req_ids:
            self.kv_connector.discard(so.finished_req_ids)
        if self.device_tokens is not None:
            for rid in (*so.finished_req_ids, *so.preempted_req_ids):
                self.device_tokens.forget(rid)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequest(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                lora=new.lora,
            )
            if new.grammar is not None:
                self.requests[new.req_id].grammar = _grammar_state(new)
            seed = new.sampling_params.seed
            if seed is not None and new.req_id not in self.generators:
                self.generators[new.req_id] = torch.Generator().manual_seed(seed)
        for cached in so.scheduled_cached_reqs:
            req = self.requests[cached.req_id]
            req.block_ids.extend(cached.new_block_ids)
            req.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput | PendingOutput:
        """Run one step; sampled ids for every request that reached a sampling position.

        On CUDA a plain greedy step returns a PendingOutput: its `result()` waits for that
        step's ids (call it from any thread); the runner itself never waits for them.
        """
        self._apply_deltas(so)
        if self.kv_connector is not None:
            self.kv_connector.commit(so, self._block_tables, self.kv_caches)
        if so.is_empty:
            return RunnerOutput()
        started = time.perf_counter()
        on_device = self.device_tokens is not None and self._plain_greedy_step(so)
        if self.device_tokens is not None:
            self.device_tokens.settle(self.requests, keep_latest=on_device)
        input_ids: list[int] = []
        positions: list[int] = []
        # (input row, row of the last step's device ids) for tokens still sampling there.
        fills: list[tuple[int, int]] = []
        # (request id, its drafts, flattened rows whose logits it samples from)
        samplers: list[tuple[str, list[int], range]] = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            seq = req.token_ids + drafts if drafts else req.token_ids
            offset = len(input_ids)
            input_ids.extend(seq[start : start + n])
            num_tokens = len(req.token_ids)
            if len(input_ids) < offset + n:  # the last token is on the GPU, still sampling
                row = self.device_tokens.latest_row(rid) if self.device_tokens else None
                if row is None or len(input_ids) != offset + n - 1:
                    raise RuntimeError(f"{rid}: input token {start + n - 1} is unknown")
                fills.append((len(input_ids), row))
                input_ids.append(0)
                num_tokens += 1
            positions.extend(range(start, start + n))
            if start + n >= num_tokens:
                first = offset + num_tokens - 1 - start
                samplers.append((rid, drafts, range(first, offset + n)))
        rows = [row for _, _, rs in samplers for row in rs]
        t_forward = time.perf_counter()
        try:
            try:
                hidden = self._forward(so, input_ids, positions, fills, rows)
                if self.kv_connector is not None and so.kv_connector_meta is not None:
                    self.kv_connector.save(so.kv_connector_meta, self._block_tables, self.kv_caches)
            finally:
                # Advanced even when the forward fails (its metadata holds the old values),
                # so the counters stay where the scheduler already has them.
                for rid, n in so.num_scheduled_tokens.items():
                    self.requests[rid].num_computed_tokens += n
            if not samplers:
                return RunnerOutput(forward_s=time.perf_counter() - t_forward)
            logits = self._logits(hidden, rows)
            if on_device and self.device_tokens is not None:
                ids = logits.argmax(dim=-1)  # [N] on the GPU; the CPU sampler's greedy choice
                return self.device_tokens.record(ids, [rid for rid, _, _ in samplers], started)
            logits = logits.cpu()
        except StepInterrupted:
            raise  # nothing was sampled; the scheduler takes the whole step back
        except Exception:
            self._after_forward_fault(samplers)
            raise
        t_sample = time.perf_counter()
        out = self._sample(samplers, logits)
        out.forward_s, out.sample_s = t_sample - t_forward, time.perf_counter() - t_sample
        return out

    def _after_forward_fault(self, samplers: list[tuple[str, list[int], range]]) -> None:
        """Leave the runner consistent after a failed forward.

        The engine ends the step's requests (their blocks are freed untrusted). Until their
        ids come back as finished, the runner's copies look as if the step had run with no
        draft accepted and a placeholder id sampled, so a step already scheduled behind
        this one (the batch queue) still lines up and its other requests are unharmed.
        """
        for rid, drafts, _ in samplers:
            req = self.requests[rid]
            req.num_computed_tokens -= len(drafts)
            req.token_ids.append(0)

    def _sample(self, samplers: list[tuple[str, list[int], range]], logits: torch.Tensor):
        """Sample every request's rows; a request whose own sampling raises fails alone."""
        groups, offset = [], 0
        for _, _, rs in samplers:
            groups.append(range(offset, offset + len(rs)))
            offset += len(rs)
        batch = self._sampling_batch(samplers)
        # Filled here, just before sampling: every earlier token of every request is known
        # on this thread, with the batch queue on or off.
        batch.bitmask, batch.bitmask_rows, grammar_failed = self._grammar_bitmask(samplers)
        drafts = [d for _, d, _ in samplers]
        verify = verify_drafts if any(drafts) else sample_one_each
        result = sample_isolated(verify, logits, batch, drafts, groups)
        result.failed.update(grammar_failed)
        for i in grammar_failed:  # its matcher is not to be trusted with another token
            self.requests[samplers[i][0]].grammar = None
        out = self._collect(samplers, result.tokens, result.logprobs)
        for i, why in result.failed.items():
            # It ends when this step is processed. _collect left a placeholder id in the
            # runner's copy, which keeps a step already scheduled after this one aligned.
            rid = samplers[i][0]
            out.failed[rid] = why
            out.sampled_token_ids.pop(rid, None)
            out.logprobs.pop(rid, None)
            out.draft_token_ids.pop(rid, None)
        if self.proposer is not None:
            self._propose(out)
        return out

    def _plain_greedy_step(self, so: SchedulerOutput) -> bool:
        return not so.scheduled_spec_decode_tokens and all(
            plain_greedy(self.requests[rid].params) and self.requests[rid].grammar is None
            for rid in so.num_scheduled_tokens
        )

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        try:
            # In the model's dtype: the sampler widens what it processes, and a plain greedy
            # step only takes argmaxes (widening [32, 49152] bf16 logits to fp32 took 0.32
            # of the 2.08 ms from LM head to token ids at batch 32; the argmax is the same).
            return self.model.compute_logits(hidden[to_device(rows, self.device)], widen=False)
        except Exception as e:
            if self.tp_driver is not None:  # a collective failed: the group is gone
                self.tp_driver.fail(f"tensor-parallel LM head failed: {e}")
            raise

    def _forward(
        self,
        so: SchedulerOutput,
        input_ids: list[int],
        positions: list[int],
        fills: list[tuple[int, int]],
        rows: list[int],
    ) -> torch.Tensor:
        reqs = [self.requests[rid] for rid in so.num_scheduled_tokens]
        num_new = list(so.num_scheduled_tokens.values())
        if self.tp_driver is not None:
            return self._forward_parallel(reqs, num_new, input_ids, positions, rows)
        fill = self._fill_from_device(fills)
        # The graphs were captured without adapters: a step with one runs eagerly.
        adapted = self.lora is not None and self.lora.begin_step([r.lora for r in reqs], num_new)
        if not adapted and self.graphs is not None and self.graphs.fits(num_new):
            return self.graphs.run(input_ids, positions, [r.block_ids for r in reqs], fill)
        meta = self.attn_backend.build_metadata(
            [r.num_computed_tokens for r in reqs],
            num_new,
            [r.block_ids for r in reqs],
            self.block_size,
            self.device,
        )
        ids = to_device(input_ids, self.device)
        if fill is not None:
            fill(ids)
        try:
            return self.model(ids, to_device(positions, self.device), self.kv_caches, meta)
        finally:
            if adapted:
                self.lora.end_step()  # type: ignore[union-attr]

    def _forward_parallel(
        self,
        reqs: list[RunnerRequest],
        num_new: list[int],
        input_ids: list[int],
        positions: list[int],
        rows: list[int],
    ) -> torch.Tensor:
        """Rank 0 of tensor parallelism: the workers get the step first, then every rank
        runs the same forward on its shard (their collectives meet inside it)."""
        assert self.tp_driver is not None
        computed = [r.num_computed_tokens for r in reqs]
        tables = [r.block_ids for r in reqs]
        self.tp_driver.publish(StepInput(input_ids, positions, computed, num_new, tables, rows))
        meta = self.attn_backend.build_metadata(
            computed, num_new, tables, self.block_size, self.device
        )
        ids, pos = to_device(input_ids, self.device), to_device(positions, self.device)
        try:
            return self.model(ids, pos, self.kv_caches, meta)
        except Exception as e:
            self.tp_driver.fail(f"tensor-parallel forward failed: {e}")
            raise

    def _fill_from_device(
        self, fills: list[tuple[int, int]]
    ) -> Callable[[torch.Tensor], None] | None:
        """A device-side copy of the last step's sampled ids into this step's input rows."""
        if not fills or self.device_tokens is None:
            return None
        dst = to_device([d for d, _ in fills], self.device)
        src = to_device([s for _, s in fills], self.device)
        sampled = self.device_tokens.pending[-1].device_ids

        def fill(ids: torch.Tensor) -> None:
            ids[dst] = sampled[src].to(ids.dtype)

        return fill

    def _sampling_batch(self, samplers: list[tuple[str, list[int], range]]) -> SamplingBatch:
        params, ids, prompts, gens, blocked = [], [], [], [], []
        for rid, drafts, rows in samplers:
            req = self.requests[rid]
            # A grammar decides itself where EOS may come (min_tokens does not apply).
            stop = [] if req.params.ignore_eos or req.grammar else self.eos_ids
            for j in range(len(rows)):
                params.append(req.params)
                # Row j scores the token after drafts[:j]: penalties count them as output.
                ids.append(req.token_ids + drafts[:j] if j else req.token_ids)
                prompts.append(req.num_prompt_tokens)
                gens.append(self.generators.get(rid))
                blocked.append(stop + req.params.stop_token_ids)
        return SamplingBatch(params, ids, prompts, gens, blocked)

    def _grammar_bitmask(
        self, samplers: list[tuple[str, list[int], range]]
    ) -> tuple[torch.Tensor | None, list[int] | None, dict[int, str]]:
        """The int32 [constrained rows, ceil(V / 32)] mask, the batch rows it covers, and
        the requests (by index) whose matcher raised: they fail alone."""
        constrained: list[tuple[int, GrammarState, list[int], int]] = []
        rows: list[int] = []
        i = 0
        for index, (rid, drafts, positions) in enumerate(samplers):
            grammar = self.requests[rid].grammar
            if grammar is not None:
                constrained.append((index, grammar, drafts, len(rows)))
                rows.extend(range(i, i + len(positions)))
            i += len(positions)
        if not constrained:
            return None, None, {}
        bitmask = allocate_bitmask(len(rows), self.cfg.vocab_size)
        failed: dict[int, str] = {}
        for index, grammar, drafts, first in constrained:
            try:
                grammar.fill_with_drafts(bitmask, first, drafts)
            except Exception as e:  # this request's grammar: it ends alone
                log.error("grammar of %s raised", samplers[index][0], exc_info=True)
                bitmask[first : first + len(drafts) + 1].fill_(-1)
                failed[index] = f"grammar failed: {type(e).__name__}: {e}"
        return bitmask, rows, failed

    def _collect(
        self,
        samplers: list[tuple[str, list[int], range]],
        tokens: list[list[int]],
        logprobs: list[list[LogprobEntry]],
    ) -> RunnerOutput:
        out = RunnerOutput()
        for (rid, drafts, _), accepted, lps in zip(samplers, tokens, logprobs):
            req = self.requests[rid]
            out.sampled_token_ids[rid] = accepted
            if req.params.logprobs is not None:
                out.logprobs[rid] = lps
            # Rejected drafts' KV gets overwritten: the scheduler steps its counter back.
            req.num_computed_tokens -= len(drafts) + 1 - len(accepted)
            if drafts and self.draft_length is not None:
                self.draft_length.observe(rid, len(drafts), len(accepted) - 1)
            req.token_ids.extend(accepted)
            grammar = req.grammar
            if (
                grammar
                and not grammar.is_terminated
                and grammar.accept_tokens(accepted) < len(accepted)
            ):
                log.warning("request %s: grammar refused a sampled token %s", rid, accepted)
        return out

    def _propose(self, out: RunnerOutput) -> None:
        """Drafts for every request that just sampled, within its k and max_tokens."""
        asks = []
        for rid in out.sampled_token_ids:
            req = self.requests[rid]
            k = self.num_speculative_tokens
            if self.draft_length is not None:
                k = min(k, self.draft_length.cap(rid))
            if req.params.num_speculative_tokens is not None:
                k = min(k, req.params.num_speculative_tokens)
            num_output = len(req.token_ids) - req.num_prompt_tokens
            k = min(k, req.params.max_tokens - num_output - 1)
            if k > 0:
                asks.append(DraftRequest(rid, req.token_ids, req.num_prompt_tokens, k))
        if asks:
            for ask, drafts in zip(asks, self.proposer.propose(asks)):  # type: ignore[union-attr]
                if drafts:
                    out.draft_token_ids[ask.req_id] = list(drafts[: ask.max_drafts])


def _grammar_state(new: NewRequestData) -> GrammarState:
    """A fresh matcher that has accepted the output this (maybe resumed) request keeps."""
    state = GrammarState(new.grammar)
    output = new.token_ids[new.num_prompt_tokens :]
    if state.accept_tokens(output) != len(output):
        log.warning("request %s: its kept output does not follow its grammar", new.req_id)
    return state


class _BlockTables(Mapping[str, list[int]]):
    """Each request's block table, as the KV connector reads it."""

    def __init__(self, requests: dict[str, RunnerRequest]) -> None:
        self._requests = requests

    def __getitem__(self, req_id: str) -> list[int]:
        return self._requests[req_id].block_ids

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)
