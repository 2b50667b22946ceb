"""grammars/: compile cache, error messages, the strict keyword rule, matchers and drafts."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xgrammar as xgr

from grammars import (
    UNENFORCED_KEYWORDS,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarState,
    allocate_bitmask,
    check_schema,
)
from runner.model_source import resolve_model
from runner.sampler import apply_token_bitmask
from runner.tokenizer import load_tokenizer

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    c = GrammarCompiler(tokenizer, VOCAB, [2])
    yield c
    c.shutdown()


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = ((bitmask[row].unsqueeze(-1) >> torch.arange(32)) & 1).flatten()
    return set(torch.nonzero(bits[:VOCAB]).flatten().tolist())


# (keyword, schema using it, an instance it forbids that xgrammar's own converter accepts)
RAW_LEAKS = [
    ("not", {"type": "integer", "not": {"const": 3}}, 3),
    ("if", {"type": "integer", "if": {"minimum": 3}, "else": {"const": 0}}, 1),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1]),
    (
        "minContains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}, "minContains": 2},
        [5, 1],
    ),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, "!!"),
    ("$dynamicRef", {"$dynamicRef": "#x"}, 1),
    ("format", {"type": "string", "format": "iri"}, "a b"),
    ("format", {"type": "string", "format": "date-time"}, "2023-02-31T12:00:00Z"),
    ("allOf", {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, 9),
    ("oneOf", {"oneOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, 3),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("multipleOf", {"type": "integer", "multipleOf": 3, "minimum": 0}, 4),
    ("maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 3}, "aaaaa"),
    (
        "required",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
        {"a": 1},
    ),
    ("anyOf", {"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 4}]}, {"x": 1}),
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, [1, 1]),
    ("enum", {"type": "string", "enum": ["a", 1]}, 1),
    ("pattern", {"type": "string", "pattern": "^(?!a)[a-z]$"}, "a"),
    (
        "additionalProperties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "patternProperties": {"^x": {"type": "string"}},
            "additionalProperties": {"type": "boolean"},
        },
        {"a": True},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {
                "x.*": {"type": "integer"},
                ".*a": {"type": "integer", "minimum": 5},
            },
        },
        {"xa": 1},
    ),
]


def _raw_accepts(compiler: GrammarCompiler, schema: dict, instance: object) -> bool:
    """What xgrammar itself does with the schema, without our rule."""
    raw = xgr.GrammarCompiler(compiler.info, max_threads=1, cache_enabled=False)
    compiled = raw.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    return _accepts(compiled, instance)


def _accepts(compiled: xgr.CompiledGrammar, instance: object) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(json.dumps(instance, separators=(",", ":"))) and m.is_completed()


@pytest.mark.parametrize(("keyword", "schema", "instance"), RAW_LEAKS)
def test_what_xgrammar_lets_through_is_enforced_or_refused(compiler, keyword, schema, instance):
    # Pins the rewrites to the installed xgrammar: if it starts enforcing one, this fails.
    assert _raw_accepts(compiler, schema, instance)
    try:
        spec = GrammarSpec.json_schema(schema)
    except GrammarError as e:
        assert f"/{keyword}" in str(e)  # refused, naming the keyword
        _, dropped = check_schema(schema, strict=False)
        assert any(d.endswith(f"/{keyword}") for d in dropped)
        GrammarSpec.checked_json_schema(schema, strict=False)  # what is left compiles
        return
    assert not _accepts(compiler.compile(spec), instance)


def test_listed_keywords_all_have_a_probe():
    probed = {k for k, _, _ in RAW_LEAKS}
    assert {k for k in UNENFORCED_KEYWORDS if not k.startswith("content")} - {
        "$recursiveRef",
        "minContains",
        "maxContains",
    } <= probed


def test_strict_rule_walks_nested_schemas_and_rewrites_loose_formats(compiler):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"contains": {}, "minContains": 2}}},
        "$defs": {"d": {"type": "string", "format": "date"}},
    }
    with pytest.raises(ValueError, match="#/properties/a/items/minContains"):
        check_schema(schema, strict=True)
    checked, dropped = check_schema(schema, strict=False)
    assert dropped == ["#/properties/a/items/minContains"]
    assert "$defs" not in checked  # resolved: nothing refers to it
    date = compiler.compile(GrammarSpec.json_schema({"type": "string", "format": "date"}))
    for text, ok in [('"2024-02-29"', True), ('"2023-02-29"', False), ('"2023-04-31"', False)]:
        m = xgr.GrammarMatcher(date)
        assert (m.accept_string(text) and m.is_completed()) == ok, text
    ip = compiler.compile(GrammarSpec.json_schema({"type": "string", "format": "ipv4"}))
    assert not xgr.GrammarMatcher(ip).accept_string('"1.02.3.4"')


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (lambda: GrammarSpec.json_schema({"type": "foo"}), "schema: #/type: unknown type 'foo'"),
        (lambda: GrammarSpec.json_schema({"$ref": "#/$defs/x"}), "#/$ref: '#/$defs/x' is not"),
        (lambda: GrammarSpec("regex", "ab[c-"), "regex: Regex parsing error at position"),
        (lambda: GrammarSpec("grammar", 'root ::= "a" rest'), 'Rule "rest" is not defined'),
        (lambda: GrammarSpec("grammar", 'start ::= "a"'), 'root rule with name "root"'),
    ],
)
def test_compile_errors_name_what_is_wrong(compiler, spec, needle):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec())
    assert needle in str(e.value) and ".cc:" not in str(e.value)


def test_cache_hits_lru_eviction_in_bytes_and_shared_in_flight_compiles(compiler):
    specs = [GrammarSpec("regex", f"[a-z]{{2}}{end}") for end in "xyz"]
    size = {s: compiler.compile(s).memory_size_bytes for s in specs}
    # The largest in the middle: evicting it makes room for the third, exactly two fit.
    big = max(specs, key=size.__getitem__)
    specs = [s for s in specs if s != big]
    specs.insert(1, big)
    sizes = [size[s] for s in specs]
    c = compiler
    with c._lock:  # start from an empty cache that holds two of the three
        c._cache.clear()
        c.stats = type(c.stats)()
    c.cache_bytes = sizes[0] + sizes[1] + min(sizes) // 2
    futures = [c.submit(specs[0]) for _ in range(4)]  # one compile, shared
    assert len({id(f) for f in futures}) == 1
    assert (c.stats.misses, c.stats.hits) == (1, 3)
    futures[0].result()
    c.compile(specs[1])
    assert c.cached_bytes() == sizes[0] + sizes[1]
    c.compile(specs[0])  # hit: most recent now
    c.compile(specs[2])  # over the byte budget: evicts specs[1], the least recently used
    assert c.cached_bytes() == sizes[0] + sizes[2] <= c.cache_bytes
    misses = c.stats.misses
    c.compile(specs[0])
    assert c.stats.misses == misses
    c.compile(specs[1])
    assert c.stats.misses == misses + 1
    assert len(c.stats.drain_compile_seconds()) == 4 and not c.stats.compile_seconds
    with pytest.raises(GrammarError):
        c.compile(GrammarSpec("regex", "("))
    assert c.stats.errors == 1
    c.cache_bytes = min(sizes) - 1  # larger than the whole budget: served, not kept
    with c._lock:
        c._cache.clear()
        c.stats.cache_bytes = 0
    assert c.compile(GrammarSpec("regex", "[a-z]{4}y")) is not None
    assert c.cached_bytes() == 0 and not c._cache
    c.cache_bytes = 256 << 20


def test_compiles_run_in_worker_processes(compiler):
    compiler.compile(GrammarSpec("regex", "off-process"))
    # At least the worker that compiled it is up (the other may still be starting).
    pids = {w.pid for w in compiler.pool.workers} - {None}
    assert pids and os.getpid() not in pids


def test_choice_literals_are_escaped(compiler, tokenizer):
    spec = GrammarSpec.choice(['say "hi"', "back\\slash", "ä"])
    compiled = compiler.compile(spec)
    for text in ['say "hi"', "back\\slash", "ä"]:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(text) and m.is_completed()
    with pytest.raises(GrammarError, match="choice"):
        GrammarSpec.choice([])


def test_accept_rollback_and_eos_only_where_the_grammar_may_end(compiler, tokenizer):
    state = GrammarState(compiler.compile(GrammarSpec("regex", "(ab)+")))
    bitmask = allocate_bitmask(1, VOCAB)
    ids = tokenizer.encode("abab")
    assert state.accept_tokens(ids) == len(ids) and state.is_completed
    state.fill(bitmask, 0)
    assert 2 in allowed(bitmask, 0)  # may end here
    state.rollback(len(ids))
    assert state.num_accepted == 0 and not state.is_completed
    state.fill(bitmask, 0)
    assert 2 not in allowed(bitmask, 0)  # EOS not allowed before the grammar may end
    assert state.accept_tokens(tokenizer.encode("x")) == 0
    with pytest.raises(ValueError):
        state.rollback(1)
    state.accept_tokens([*tokenizer.encode("ab"), 2])
    assert state.is_terminated
    state.fill(bitmask, 0)  # a step in flight may still sample for it: anything goes
    assert len(allowed(bitmask, 0)) == VOCAB


def test_fill_with_made_up_drafts_matches_step_by_step_and_leaves_state(compiler, tokenizer):
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    )
    compiled = compiler.compile(spec)
    drafts = tokenizer.encode('{"n":12')
    state = GrammarState(compiled)
    state.accept_tokens(drafts[:1])  # kept output so far
    rest = drafts[1:]
    mask = allocate_bitmask(len(rest) + 1, VOCAB)
    state.fill_with_drafts(mask, 0, rest)
    assert state.num_accepted == 1
    # The same rows from a fresh matcher advanced for real, one token at a time.
    ref = GrammarState(compiled)
    ref.accept_tokens(drafts[:1])
    expected = allocate_bitmask(len(rest) + 1, VOCAB)
    for j in range(len(rest) + 1):
        ref.fill(expected, j)
        if j < len(rest):
            ref.accept_tokens([rest[j]])
    assert torch.equal(mask, expected)
    # The state is where it was: the next fill equals the first row.
    again = allocate_bitmask(1, VOCAB)
    state.fill(again, 0)
    assert torch.equal(again[0], mask[0])
    # A draft the grammar refuses: its row forbids it, the rows after it allow everything.
    bad = [*tokenizer.encode('"n'), tokenizer.encode("x")[0], tokenizer.encode("y")[0]]
    fresh = GrammarState(compiled)
    fresh.accept_tokens(tokenizer.encode("{"))
    mask = allocate_bitmask(len(bad) + 1, VOCAB)
    fresh.fill_with_drafts(mask, 0, bad)
    refused = next(j for j in range(len(bad)) if bad[j] not in allowed(mask, j))
    assert all(len(allowed(mask, j)) == VOCAB for j in range(refused + 1, len(bad) + 1))
    assert fresh.num_accepted == 1


def test_bitmask_applies_to_the_listed_rows_only():
    logits = torch.randn(4, 70)
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 2] = 1  # token 64
    out = logits.clone()
    apply_token_bitmask(out, mask, rows=[1, 3])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [64]
    assert out[3, 64] == logits[3, 64]


@pytest.mark.parametrize(
    ("pattern", "text", "ok"),
    [
        ("a.b", "axb", True),
        ("a.b", "a\nb", False),  # `.` stops at a newline, as in Python and JavaScript
        ("(?s)a.b", "a\nb", True),  # ... unless the pattern sets the s flag
        ("a[.]b", "a.b", True),
        ("a(\\.[0-9]+)?", "a12", False),  # xgrammar alone accepts this one
        ("a(\\.[0-9]+)?", "a.12", True),
        ("a(\\.[0-9]+)?", "a", True),
    ],
)
def test_guided_regex_dialect(compiler, tokenizer, pattern, text, ok):
    m = xgr.GrammarMatcher(compiler.compile(GrammarSpec("regex", pattern)))
    assert (m.accept_string(text) and m.is_completed()) == ok


def test_optional_groups_work_around_xgrammar(compiler):
    schema = {"type": "string", "pattern": "^a(\\.[0-9]+)?$"}
    # The fault the rewrite avoids (this fails once it is fixed upstream)...
    assert _raw_accepts(compiler, schema, "a12")
    # ... and with the rewrite the dot is required again.
    assert not _accepts(compiler.compile(GrammarSpec.json_schema(schema)), "a12")
    assert _accepts(compiler.compile(GrammarSpec.json_schema(schema)), "a.12")
