"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It mirrors the scheduler's view of each running request (token ids, block table, progress)
from the deltas in SchedulerOutput, so it never calls back into the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from runner.attention import build_metadata
from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM
from runner.sampler import SamplingBatch, sample, verify_greedy_drafts
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
        t_forward = time.perf_counter()
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        if not samplers:
            return RunnerOutput(forward_s=time.perf_counter() - t_forward)
        rows = [row for _, _, rs in samplers for row in rs]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        logits = logits.cpu()
        t_sample = time.perf_counter()
        result = sample(logits, self._sampling_batch(samplers))
        out = self._collect(samplers, result.token_ids, result.logprobs)
        out.forward_s, out.sample_s = t_sample - t_forward, time.perf_counter() - t_sample
        return out

    def _sampling_batch(self, samplers: list[tuple[str, list[int], range]]) -> SamplingBatch:
        params, ids, prompts, gens, blocked = [], [], [], [], []
        for rid, _, rows in samplers:
            req = self.requests[rid]
            stop = [] if req.params.ignore_eos else self.eos_ids
            for _ in rows:
                params.append(req.params)
                ids.append(req.token_ids)
                prompts.append(req.num_prompt_tokens)
                gens.append(self.generators.get(rid))
                blocked.append(stop + req.params.stop_token_ids)
        return SamplingBatch(params, ids, prompts, gens, blocked)

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
            i += len(rows)
        return out
