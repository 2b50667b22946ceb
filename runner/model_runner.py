"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It mirrors the scheduler's view of each running request (token ids, block table, progress)
from the deltas in SchedulerOutput, so it never calls back into the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.attention import build_metadata
from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM
from runner.rejection_sampler import LogprobEntry, verify_drafts
from runner.sampler import SamplingBatch, sample
from runner.spec_decode import DraftRequest, Proposer
from runner.spec_decode.draft_length import AdaptiveDraftLength
from scheduling import RunnerOutput, SamplingParams, SchedulerOutput


@dataclass(slots=True)
class RunnerRequest:
    """The runner's copy of one running request."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


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
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.model, self.cfg = model, cfg
        # Speculative decoding: drafts proposed right after sampling, verified next step.
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer else 0
        # None: every request gets the full k each step.
        self.draft_length: AdaptiveDraftLength | None = None
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
            if self.draft_length is not None:
                self.draft_length.drop(rid)
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
        if any(drafts for _, drafts, _ in samplers):
            tokens, logprobs = verify_drafts(logits.cpu(), batch, [d for _, d, _ in samplers])
        else:
            result = sample(logits.cpu(), batch)
            tokens = [[t] for t in result.token_ids]
            logprobs = [[lp] if lp is not None else [] for lp in result.logprobs]
        out = self._collect(samplers, tokens, logprobs)
        if self.proposer is not None:
            self._propose(out)
        return out

    def _sampling_batch(self, samplers: list[tuple[str, list[int], range]]) -> SamplingBatch:
        params, ids, prompts, gens, blocked = [], [], [], [], []
        for rid, drafts, rows in samplers:
            req = self.requests[rid]
            stop = [] if req.params.ignore_eos else self.eos_ids
            for j in range(len(rows)):
                params.append(req.params)
                # Row j scores the token after drafts[:j]: penalties count them as output.
                ids.append(req.token_ids + drafts[:j] if j else req.token_ids)
                prompts.append(req.num_prompt_tokens)
                gens.append(self.generators.get(rid))
                blocked.append(stop + req.params.stop_token_ids)
        return SamplingBatch(params, ids, prompts, gens, blocked)

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
