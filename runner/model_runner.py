"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It mirrors the scheduler's view of each running request (token ids, block table, progress)
from the deltas in SchedulerOutput, so it never calls back into the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.attention_backends import select_attention_backend
from runner.device_queue import DeviceTokens, PendingOutput, plain_greedy, to_device
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
        attention_backend: str = "auto",
        decode_graphs: tuple[int, int] | None = None,
    ) -> None:
        """`decode_graphs` = (max_num_seqs, max_model_len) captures CUDA graphs for
        decode-only steps (CUDA with the Triton backend only; ignored elsewhere)."""
        self.model, self.cfg = model, cfg
        self.block_size, self.device = block_size, device
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        self.attn_backend = select_attention_backend(
            device, cfg.num_key_value_heads, attention_backend
        )
        if hasattr(model, "set_attention_backend"):
            model.set_attention_backend(self.attn_backend)
        elif self.attn_backend.name != "torch":
            raise ValueError(f"{type(model).__name__} cannot take the {self.attn_backend.name} "
                             "attention backend (it has no set_attention_backend)")  # fmt: skip
        self.graphs = None
        if decode_graphs and device.type == "cuda" and self.attn_backend.name == "triton":
            from runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv_caches, *decode_graphs, block_size, device)
            self.graphs.capture()
        # CUDA: greedy steps leave their ids on the GPU (runner/device_queue.py).
        self.device_tokens = DeviceTokens() if device.type == "cuda" else None
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
            )
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
        hidden = self._forward(so, input_ids, positions, fills)
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        if not samplers:
            return RunnerOutput()
        rows = [row for _, _, rs in samplers for row in rs]
        logits = self.model.compute_logits(hidden[to_device(rows, self.device)])
        if on_device and self.device_tokens is not None:
            ids = logits.argmax(dim=-1)  # [N] on the GPU; the CPU sampler's greedy choice
            return self.device_tokens.record(ids, [rid for rid, _, _ in samplers], started)
        result = sample(logits.cpu(), self._sampling_batch(samplers))
        return self._collect(samplers, result.token_ids, result.logprobs)

    def _plain_greedy_step(self, so: SchedulerOutput) -> bool:
        return not so.scheduled_spec_decode_tokens and all(
            plain_greedy(self.requests[rid].params) for rid in so.num_scheduled_tokens
        )

    def _forward(
        self,
        so: SchedulerOutput,
        input_ids: list[int],
        positions: list[int],
        fills: list[tuple[int, int]],
    ) -> torch.Tensor:
        reqs = [self.requests[rid] for rid in so.num_scheduled_tokens]
        num_new = list(so.num_scheduled_tokens.values())
        fill = self._fill_from_device(fills)
        if self.graphs is not None and self.graphs.fits(num_new):
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
        return self.model(ids, to_device(positions, self.device), self.kv_caches, meta)

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
