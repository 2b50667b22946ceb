"""Constrained generation on the embedded model: every output obeys its grammar.

One batch holds every constraint (JSON Schemas, regexes, choices, EBNF) at temperature 0.7
over several seeds, plus unconstrained greedy neighbours and one broken grammar.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re

import jsonschema
import pytest
import torch
from model_fixtures import engine_for
from structured_cases import ARITHMETIC, CHOICES, REGEXES, SCHEMAS, SQL

from daemon.engine.async_engine import AsyncEngine
from daemon.engine.engine import Completion
from daemon.engine.loaded_model import LoadedModel
from grammars import GrammarSpec
from runner.model_runner import kv_bytes_per_block
from scheduling import RequestStatus, SamplingParams

SEEDS = (1, 2, 3)
MAX_TOKENS = 120
PLAIN = ["What is the capital of France?", "Name a fruit."]


def chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return loaded.tokenizer.encode(rendered)


def constrained_cases() -> list[tuple[str, GrammarSpec, object]]:
    cases: list[tuple[str, GrammarSpec, object]] = []
    cases += [("Reply in JSON.", GrammarSpec.json_schema(s), s) for s in SCHEMAS]
    cases += [("Write one example.", GrammarSpec("regex", r), r) for r in REGEXES]
    cases += [("Pick one.", GrammarSpec.choice(c), c) for c in CHOICES]
    cases += [("A sum:", GrammarSpec("grammar", ARITHMETIC), "arithmetic")]
    cases += [("A query:", GrammarSpec("grammar", SQL), "sql")]
    return cases


@pytest.fixture(scope="module")
def batch(smollm):
    """Run everything as one batch; results by kind."""
    engine = engine_for(smollm, kv_cache_memory=768 << 20, max_num_seqs=256, max_waiting=0)
    prompts, params, grammars, keys = [], [], [], []
    # Unconstrained rows first and in between: the mask rows are not the batch rows.
    greedy = SamplingParams(max_tokens=8, temperature=0)
    for text in PLAIN:
        prompts.append(chat_ids(smollm, text))
        params.append(greedy)
        grammars.append(None)
        keys.append(("plain", text))
    prompts.append(chat_ids(smollm, "x"))
    params.append(greedy)
    grammars.append(GrammarSpec("regex", "(a|"))
    keys.append(("broken", None))
    for prompt, spec, what in constrained_cases():
        for seed in SEEDS:
            prompts.append(chat_ids(smollm, prompt))
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=seed))
            grammars.append(spec)
            keys.append((spec.kind, what))
    results = engine.generate(prompts, params, grammars)
    alone = engine.generate([chat_ids(smollm, t) for t in PLAIN], greedy)
    return engine, list(zip(keys, results)), alone


def outputs(batch, kind: str) -> list[tuple[object, Completion]]:
    return [(what, c) for (k, what), c in batch[1] if k == kind]


def test_json_schema_outputs_validate(batch):
    got = outputs(batch, "json_schema")
    assert len(got) == len(SCHEMAS) * len(SEEDS) and len(SCHEMAS) >= 30
    for schema, c in got:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema, format_checker=jsonschema.FormatChecker())


def test_regex_outputs_fullmatch(batch):
    for pattern, c in outputs(batch, "regex"):
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), (pattern, c.text)


def test_choice_outputs_are_exactly_one_choice(batch):
    for choices, c in outputs(batch, "choice"):
        assert c.finish_reason == "stop" and c.text in choices, (choices, c.text)


def test_ebnf_outputs_parse(batch):
    for what, c in outputs(batch, "grammar"):
        assert c.finish_reason == "stop", c.text
        if what == "arithmetic":
            tree = ast.parse(c.text, mode="eval")  # a Python expression of ints and + - * /
            allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
            assert all(isinstance(n, allowed) for n in ast.walk(tree)), c.text
        else:
            assert re.fullmatch(
                r"SELECT (\*|(id|name|age|city)(, (id|name|age|city)){0,2}) FROM (users|orders)"
                r"( WHERE (id|name|age|city) [=<>] ([0-9]{1,3}|'[a-z]{1,6}'))?;",
                c.text,
            ), c.text


def test_unconstrained_neighbours_are_unchanged_and_nothing_leaks(batch):
    engine, results, alone = batch
    plain = [c for (k, _), c in results if k == "plain"]
    assert [c.token_ids for c in plain] == [c.token_ids for c in alone]
    ((_, broken),) = outputs(batch, "broken")
    assert broken.finish_reason == "error" and "regex" in broken.error and not broken.token_ids
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    stats = engine.grammars.stats
    assert stats.misses == len(constrained_cases()) + 1 and stats.errors == 1


def test_waiting_for_grammar_holds_no_blocks(smollm):
    engine = engine_for(smollm, kv_cache_memory=32 << 20)
    rid = engine.add_request(
        chat_ids(smollm, "x"), SamplingParams(max_tokens=4), grammar=GrammarSpec("regex", "ab")
    )
    req = engine.scheduler.requests[rid]
    assert req.status == RequestStatus.WAITING_FOR_GRAMMAR
    so = engine.scheduler.schedule()  # the scheduler alone does not release it
    assert so.is_empty and not engine.kv.req_to_blocks.get(rid)
    engine.scheduler.check_integrity()
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request([1, 2], SamplingParams(ignore_eos=True), grammar=GrammarSpec("json"))
    while engine.has_unfinished_requests():
        engine.step()
    assert req.status == RequestStatus.FINISHED_STOPPED and req.grammar is not None


async def _run_async(engine, prompts, params, grammars) -> list[list[int]]:
    async def one(p, g):
        out: list[int] = []
        async for d in engine.generate(p, params, grammar=g):
            out += d.new_token_ids
        return out

    try:
        return await asyncio.gather(*(one(p, g) for p, g in zip(prompts, grammars)))
    finally:
        await engine.stop()


async def test_constrained_greedy_same_with_overlap_and_preemption(smollm):
    specs = [GrammarSpec.json_schema(s) for s in (SCHEMAS[0], SCHEMAS[12])]
    specs += [GrammarSpec("regex", REGEXES[0]), GrammarSpec("grammar", SQL)]
    prompts = [chat_ids(smollm, "Reply in JSON."), *(chat_ids(smollm, "Go.") for _ in specs[1:])]
    params = SamplingParams(max_tokens=40, temperature=0)
    reference = engine_for(smollm, kv_cache_memory=64 << 20).generate(prompts, params, specs)
    assert all(c.finish_reason == "stop" for c in reference), [c.text for c in reference]
    per_block = kv_bytes_per_block(smollm.config, 16, torch.float32)
    for overlap in (True, False):
        # Room for about two requests: the others are preempted and recomputed.
        engine = AsyncEngine(
            engine_for(smollm, kv_cache_memory=8 * per_block, max_num_batched_tokens=128), overlap
        )
        got = await _run_async(engine, prompts, params, specs)
        assert engine.engine.scheduler.num_preemptions > 0, overlap
        assert got == [c.token_ids for c in reference], overlap
        kv = engine.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
