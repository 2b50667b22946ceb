"""A fault attributable to one request ends that request only; a forward fault ends its step.

Each fault kind is injected for real: the sampler gets an out-of-vocabulary logit_bias id
(admission check bypassed), the detokenizer raises for one marked request, the forward
raises once. Every test ends with the KV pool empty and consistent.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from reliability_fixtures import api_client, assert_pool_empty, make_engine, wait_idle

import daemon.engine.engine as engine_module
from daemon.engine.async_engine import AsyncEngine
from daemon.engine.detokenizer import IncrementalDetokenizer
from grammars import GrammarSpec, GrammarState
from scheduling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(5)]


async def run(engine: AsyncEngine, prompt: list[int], params: SamplingParams, **kw):
    ids, reason, why = [], None, None
    async for d in engine.generate(prompt, params, **kw):
        ids += d.new_token_ids
        reason, why = d.finish_reason, d.stop_reason
    return ids, reason, why


async def reference(tiny) -> list[list[int]]:
    engine = AsyncEngine(make_engine(tiny), overlap=False)
    try:
        return [r[0] for r in await asyncio.gather(*(run(engine, p, GREEDY) for p in PROMPTS))]
    finally:
        await engine.stop()


@pytest.mark.parametrize("overlap", [False, True])
async def test_sampler_fault_ends_only_its_request(tiny, monkeypatch, overlap):
    expected = await reference(tiny)
    # The admission check would answer 400; bypass it so the fault happens in the sampler.
    monkeypatch.setattr(engine_module, "check_vocab", lambda params, vocab: None)
    engine = AsyncEngine(make_engine(tiny), overlap=overlap)
    bad = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={99999999: 5})
    try:
        jobs = [run(engine, p, GREEDY) for p in PROMPTS]
        jobs.insert(2, run(engine, PROMPTS[0], bad))
        results = await asyncio.gather(*jobs)
        bad_result = results.pop(2)
        assert bad_result[1] == "error" and "sampling failed" in bad_result[2]
        assert [r[0] for r in results] == expected  # batch-mates unharmed, same tokens
        assert all(r[1] == "length" for r in results)
        await wait_idle(engine)
    finally:
        await engine.stop()
    assert_pool_empty(engine)


async def test_detokenizer_fault_ends_only_its_request(tiny, monkeypatch):
    original = IncrementalDetokenizer.add

    def add(self, token_ids):
        if "BOOM" in self.params.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    engine = AsyncEngine(make_engine(tiny), overlap=False)
    marked = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=["BOOM"])
    try:
        jobs = [run(engine, p, GREEDY) for p in PROMPTS]
        jobs.append(run(engine, PROMPTS[1], marked))
        results = await asyncio.gather(*jobs)
        assert results[-1][1] == "error" and "detokenizing failed" in results[-1][2]
        assert all(r[1] == "length" and len(r[0]) == 6 for r in results[:-1])
        await wait_idle(engine)
    finally:
        await engine.stop()
    assert_pool_empty(engine)


async def test_grammar_fault_ends_only_its_request(tiny, monkeypatch):
    """A matcher that raises while filling its bitmask ends its own request, not the step."""
    expected = await reference(tiny)
    original = GrammarState.fill_with_drafts

    def fill_with_drafts(self, bitmask, first_row, drafts):
        if self.num_accepted >= 2:  # let the request get going first
            raise RuntimeError("injected grammar fault")
        return original(self, bitmask, first_row, drafts)

    monkeypatch.setattr(GrammarState, "fill_with_drafts", fill_with_drafts)
    engine = AsyncEngine(make_engine(tiny), overlap=False)
    constrained = SamplingParams(max_tokens=6, temperature=0)
    try:
        jobs = [run(engine, p, GREEDY) for p in PROMPTS]
        jobs.append(
            run(engine, PROMPTS[1], constrained, grammar=GrammarSpec("regex", "[a-z ]{1,40}"))
        )
        results = await asyncio.gather(*jobs)
        assert results[-1][1] == "error" and "grammar failed" in results[-1][2]
        assert [r[0] for r in results[:-1]] == expected
        await wait_idle(engine)
    finally:
        await engine.stop()
    assert_pool_empty(engine)


@pytest.mark.parametrize("overlap", [False, True])
async def test_forward_fault_fails_its_step_and_the_engine_goes_on(tiny, monkeypatch, overlap):
    expected = await reference(tiny)
    engine = AsyncEngine(make_engine(tiny), overlap=overlap)
    model = engine.engine.runner.model
    original_forward = model.forward
    calls = {"n": 0}
    failed_steps: list[set[str]] = []
    original_execute = engine.engine.execute

    def forward(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward fault")
        return original_forward(*args, **kw)

    def execute(so):
        try:
            return original_execute(so)
        except RuntimeError:
            failed_steps.append(set(so.num_scheduled_tokens))
            raise

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(engine.engine, "execute", execute)
    try:
        streams = [engine.add_request(p, GREEDY) for p in PROMPTS]

        async def drain(stream):
            ids, reason = [], None
            async for d in stream:
                ids += d.new_token_ids
                reason = d.finish_reason
            return stream.request_id, ids, reason

        results = await asyncio.gather(*(drain(s) for s in streams))
        assert len(failed_steps) == 1
        for (rid, ids, reason), want in zip(results, expected):
            if rid in failed_steps[0]:
                assert reason == "error"
            else:
                assert reason == "length" and ids == want
        assert any(r[2] == "error" for r in results)
        # The daemon keeps serving: the same prompts again give the reference tokens.
        again = await asyncio.gather(*(run(engine, p, GREEDY) for p in PROMPTS))
        assert [r[0] for r in again] == expected
        await wait_idle(engine)
    finally:
        await engine.stop()
    assert_pool_empty(engine)


async def test_a_stream_that_fails_sends_an_error_event_the_client_raises_on(tiny, monkeypatch):
    original = IncrementalDetokenizer.add

    def add(self, token_ids):
        self.count = getattr(self, "count", 0) + 1
        if "BOOM" in self.params.stop and self.count == 3:
            raise ValueError("injected")
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    async with api_client(tiny) as (client, _):
        body = {"prompt": "Hi", "max_tokens": 8, "stop": ["BOOM"], "stream": True}
        r = await client.post("/v1/completions", json=body)
        text = await r.text()
        events = [e[len("data: ") :] for e in text.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        assert '"error"' in events[-2] and '"message"' in events[-2] and '"code":500' in events[-2]
        assert '"finish_reason":"error"' not in text  # only OpenAI's finish reasons

        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="generation failed"):
            async for _ in await sdk.completions.create(
                model="tiny", prompt="Hi", max_tokens=8, stop=["BOOM"], stream=True
            ):
                pass
        # Not streaming: a 500 with the JSON error.
        r = await client.post("/v1/completions", json={**body, "stream": False})
        assert r.status == 500 and "generation failed" in (await r.json())["error"]["message"]
        await sdk.close()
