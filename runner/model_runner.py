"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It mirrors the scheduler's view of each running request (token ids, block table, progress)
from the deltas in SchedulerOutput, so it never calls back into the scheduler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from grammars import GrammarState, allocate_bitmask
from runner.attention import build_metadata
from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM
from runner.sampler import SamplingBatch, sample, verify_greedy_drafts
from scheduling import NewRequestData, RunnerOutput, SamplingParams, SchedulerOutput

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


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.kv_size * itemsize


class ModelRunner:
    """Owns the model and the KV cache tensors; executes one step at a time."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.cfg = model, cfg
        self.block_size, self.device = block_size, device
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        self.requests: dict[str, RunnerRequest] = {}
        # Seeded generators outlive preemption, so a resumed request continues its sequence.
        self.generators: dict[str, torch.Generator] = {}
        # Ids held back while a request is short of min_tokens (unless it ignores EOS).
        self.eos_ids = sorted(set(cfg.eos_token_ids))

    def _apply_deltas(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequest(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
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
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one step; sampled ids for every request that reached a sampling position."""
        self._apply_deltas(so)
        if so.is_empty:
            return RunnerOutput()
        input_ids: list[int] = []
        positions: list[int] = []
        # (request id, its drafts, flattened rows whose logits it samples from)
        samplers: list[tuple[str, list[int], range]] = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            seq = req.token_ids + drafts if drafts else req.token_ids
            offset = len(input_ids)
            input_ids.extend(seq[start : start + n])
            positions.extend(range(start, start + n))
            if start + n >= len(req.token_ids):
                first = offset + len(req.token_ids) - 1 - start
                samplers.append((rid, drafts, range(first, offset + n)))
        reqs = [self.requests[rid] for rid in so.num_scheduled_tokens]
        meta = build_metadata(
            [r.num_computed_tokens for r in reqs],
            list(so.num_scheduled_tokens.values()),
            [r.block_ids for r in reqs],
            self.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        if not samplers:
            return RunnerOutput()
        rows = [row for _, _, rs in samplers for row in rs]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        batch = self._sampling_batch(samplers)
        # Filled here, just before sampling: every earlier token of every request is known
        # on this thread, with the batch queue on or off.
        batch.bitmask, batch.bitmask_rows = self._grammar_bitmask(samplers)
        result = sample(logits.cpu(), batch)
        return self._collect(samplers, result.token_ids, result.logprobs)

    def _sampling_batch(self, samplers: list[tuple[str, list[int], range]]) -> SamplingBatch:
        params, ids, prompts, gens, blocked = [], [], [], [], []
        for rid, _, rows in samplers:
            req = self.requests[rid]
            # A grammar decides itself where EOS may come (min_tokens does not apply).
            stop = [] if req.params.ignore_eos or req.grammar else self.eos_ids
            for _ in rows:
                params.append(req.params)
                ids.append(req.token_ids)
                prompts.append(req.num_prompt_tokens)
                gens.append(self.generators.get(rid))
                blocked.append(stop + req.params.stop_token_ids)
        return SamplingBatch(params, ids, prompts, gens, blocked)

    def _grammar_bitmask(
        self, samplers: list[tuple[str, list[int], range]]
    ) -> tuple[torch.Tensor | None, list[int] | None]:
        """The int32 [constrained rows, ceil(V / 32)] mask and the batch rows it covers."""
        constrained: list[tuple[GrammarState, list[int], int]] = []
        rows: list[int] = []
        i = 0
        for rid, drafts, positions in samplers:
            grammar = self.requests[rid].grammar
            if grammar is not None:
                constrained.append((grammar, drafts, len(rows)))
                rows.extend(range(i, i + len(positions)))
            i += len(positions)
        if not constrained:
            return None, None
        bitmask = allocate_bitmask(len(rows), self.cfg.vocab_size)
        for grammar, drafts, first in constrained:
            grammar.fill_with_drafts(bitmask, first, drafts)
        return bitmask, rows

    def _collect(
        self,
        samplers: list[tuple[str, list[int], range]],
        token_ids: list[int],
        logprobs: list,
    ) -> RunnerOutput:
        out = RunnerOutput()
        i = 0
        for rid, drafts, rows in samplers:
            req = self.requests[rid]
            chosen = token_ids[i : i + len(rows)]
            if not drafts:
                accepted = chosen[:1]
            elif req.params.greedy:
                accepted = verify_greedy_drafts(chosen, drafts)
            else:
                # Sampling without draft probabilities: take the first position's token and
                # no drafts. Correct, just no speed-up (rejection sampling: spec-decode issue).
                accepted = chosen[:1]
            out.sampled_token_ids[rid] = accepted
            if req.params.logprobs is not None:
                out.logprobs[rid] = logprobs[i : i + len(accepted)]
            # Rejected drafts' KV gets overwritten: the scheduler steps its counter back.
            req.num_computed_tokens -= len(drafts) + 1 - len(accepted)
            req.token_ids.extend(accepted)
            grammar = req.grammar
            if (
                grammar
                and not grammar.is_terminated
                and grammar.accept_tokens(accepted) < len(accepted)
            ):
                log.warning("request %s: grammar refused a sampled token %s", rid, accepted)
            i += len(rows)
        return out


def _grammar_state(new: NewRequestData) -> GrammarState:
    """A fresh matcher that has accepted the output this (maybe resumed) request keeps."""
    state = GrammarState(new.grammar)
    output = new.token_ids[new.num_prompt_tokens :]
    if state.accept_tokens(output) != len(output):
        log.warning("request %s: its kept output does not follow its grammar", new.req_id)
    return state
