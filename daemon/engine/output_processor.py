"""Turns the scheduler's `RequestOutput`s into `Delta`s: text, and stop strings applied.

One `IncrementalDetokenizer` per live request. A stop string found in a step's tokens
ends the request there; the engine finishes it in the scheduler when told so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from daemon.engine.detokenizer import IncrementalDetokenizer
from daemon.engine.outputs import Delta
from scheduling import RequestOutput, SamplingParams


class OutputProcessor:
    """The detokenizers of the live requests; only the engine's owner thread calls it."""

    def __init__(self) -> None:
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def __len__(self) -> int:
        return len(self._detokenizers)

    def add(
        self, request_id: str, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._detokenizers[request_id] = IncrementalDetokenizer(tokenizer, prompt_ids, params)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._detokenizers.pop(rid, None)

    def delta(self, out: RequestOutput) -> tuple[Delta, bool]:
        """`out` as a Delta, and whether a stop string ended the request in this step."""
        detok = self._detokenizers.get(out.request_id)
        text = detok.add(out.new_token_ids) if detok else ""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        token_ids, logprobs = out.new_token_ids, out.new_logprobs
        completion_tokens = out.num_output_tokens
        # Several tokens per step (speculation): a stop string completed before the last
        # token ends the request there, even if a later one was EOS or the length limit.
        stopped = detok is not None and detok.stop_reason is not None
        extra = len(token_ids) - detok.stop_token_count if stopped else 0  # type: ignore[union-attr]
        stop_here = stopped and (finish_reason is None or extra > 0)
        if stop_here:
            finish_reason, stop_reason = "stop", detok.stop_reason  # type: ignore[union-attr]
            if extra > 0:
                token_ids = token_ids[:-extra]
                logprobs = logprobs[:-extra] if logprobs else logprobs
                completion_tokens -= extra
        if finish_reason is not None and detok is not None:
            text += detok.flush()
            del self._detokenizers[out.request_id]
        delta = Delta(
            out.request_id,
            token_ids,
            finish_reason,
            stop_reason,
            logprobs,
            out.num_prompt_tokens,
            completion_tokens,
            out.num_cached_tokens,
            out.spec_stats,
            text,
        )
        return delta, stop_here
