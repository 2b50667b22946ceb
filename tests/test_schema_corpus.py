"""The schema corpus (tests/schema_corpus/) through the real matcher, token by token.

Every keyword class is enforced — each valid instance is accepted, each invalid one refused
by the matcher — or refused with the keyword named. Random walks through each compiled
grammar (a stand-in for a random model) end in outputs that jsonschema validates.
"""

from __future__ import annotations

import json
import random

import pytest

from grammars import GrammarCompiler, GrammarError, GrammarSpec, GrammarState
from grammars.schema.validation import output_errors
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer
from tests.schema_corpus import CASES
from tests.schema_corpus.oracles import validate
from tests.schema_corpus.walk import STOP, VOCAB, random_walk

ENFORCED = [c for c in CASES if c.refused is None]
REFUSED = [c for c in CASES if c.refused is not None]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [STOP])


def _text(instance: object) -> str:
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


def _accepts(compiler, tokenizer, schema: dict, instance: object) -> bool:
    state = GrammarState(compiler.compile(GrammarSpec.json_schema(schema)))
    ids = tokenizer.encode(_text(instance), add_special_tokens=False)
    return state.accept_tokens(ids) == len(ids) and state.accept_tokens([STOP]) == 1


def test_corpus_instances_are_what_they_claim():
    for case in ENFORCED:
        for v in case.valid:
            assert validate(v, case.schema), (case.name, v)
        for v in case.invalid:
            assert not validate(v, case.schema), (case.name, v)
        assert case.valid and case.invalid, case.name


@pytest.mark.parametrize("case", ENFORCED, ids=lambda c: c.name)
def test_enforced_classes_accept_valid_and_refuse_invalid_token_by_token(compiler, tokenizer, case):
    for v in case.valid:
        assert _accepts(compiler, tokenizer, case.schema, v), (case.name, "valid", v)
    for v in case.invalid:
        assert not _accepts(compiler, tokenizer, case.schema, v), (case.name, "invalid", v)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_refused_classes_name_the_keyword(case):
    with pytest.raises(GrammarError) as e:
        GrammarSpec.json_schema(case.schema)
    message = str(e.value)
    if case.refused == "unsatisfiable":
        assert "no value satisfies" in message
    else:
        assert f"/{case.refused}:" in message, message
    assert "#" in message  # a JSON pointer


def test_random_walks_end_in_valid_outputs(compiler, tokenizer):
    rng = random.Random(0)
    finished = 0
    for case in ENFORCED:
        compiled = compiler.compile(GrammarSpec.json_schema(case.schema))
        for _ in range(3):
            text = random_walk(compiled, tokenizer, rng, max_tokens=24)
            if text is None:
                continue
            finished += 1
            assert validate(json.loads(text), case.schema), (case.name, text)
    assert finished >= len(ENFORCED)  # most walks end: the check above ran on them


def test_output_check_reads_formats_in_the_schemas_draft():
    """The safety net's `time` is RFC 3339's (offset required), not draft 3's HH:MM:SS."""
    schema = {"type": "string", "format": "time"}
    assert output_errors(schema, "23:51:16.16Z") == []
    assert output_errors(schema, "07:00:55+22:37") == []
    assert output_errors(schema, "07:00:55") != []
    assert output_errors(schema, "25:00:00Z") != []
