"""`Engine.generate`: a batch of prompts run to completion in the caller's thread (scripts,
`headrace generate`, tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from daemon.engine.outputs import Completion
from grammars import GrammarSpec
from scheduling import SamplingParams

if TYPE_CHECKING:
    from daemon.engine.engine import Engine


def generate(
    engine: Engine,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    grammars: Sequence[GrammarSpec | None] | None,
    loras: Sequence[str | None] | None,
) -> list[Completion]:
    per_params = params if isinstance(params, Sequence) else [params] * len(prompts)
    per_grammar = grammars if grammars is not None else [None] * len(prompts)
    per_lora = loras if loras is not None else [None] * len(prompts)
    ids = [
        engine.add_request(p, sp, grammar=g, lora=lora)
        for p, sp, g, lora in zip(prompts, per_params, per_grammar, per_lora, strict=True)
    ]
    results = {rid: Completion(rid) for rid in ids}
    # Offline, the batch starts together once its grammars are compiled: the steps (and so
    # the outputs) do not depend on how fast the compile workers were.
    engine.grammars.wait_compiled()
    while engine.has_unfinished_requests():
        for d in engine.step():
            c = results.get(d.request_id)
            if c is None:
                continue
            c.text += d.text
            c.token_ids += d.new_token_ids
            if d.finished:
                c.finish_reason = d.finish_reason
                c.error = d.bad_request
                c.prompt_tokens, c.cached_tokens = d.num_prompt_tokens, d.num_cached_tokens
    engine.release_finished()
    return [results[rid] for rid in ids]
