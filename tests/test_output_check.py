"""The strict safety net (daemon/openai/output_check.py), generic tool calls."""

from __future__ import annotations

import asyncio

import pytest

from daemon.engine.outputs import Delta
from daemon.openai.choices import Choice
from daemon.openai.generic_tools import GenericToolParser
from daemon.openai.output_check import OutputCheck
from daemon.openai.protocol import GenerationRequest
from daemon.openai.responses import ResponseBuilder
from daemon.openai.structured_output import parse_constraint
from daemon.openai.tools import ToolRequest, prepare_chat
from scheduling import SamplingParams

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize(
    ("text", "finish", "failed"),
    [
        ('{"x":1}', "stop", False),
        ('{"x":"a"}', "stop", True),
        ('{"x":', "stop", True),  # not JSON at all
        ('{"x":', "length", False),  # cut by max_tokens: already says so
    ],
)
def test_failure_only_for_stopped_outputs_that_break_the_schema(text, finish, failed):
    assert (OutputCheck(POINT).failure(text, finish) is not None) == failed


def test_numbers_past_a_double_are_json_but_nan_and_infinity_are_not():
    # The JSON grammar allows any exponent; the fuzzer saw a model write one past 1e308.
    anything = {}
    assert OutputCheck(anything).failure('{"a": 1e999, "b": -2E+400}', "stop") is None
    assert OutputCheck({"type": "integer"}).failure("1e999", "stop") is not None  # not an int
    assert "not JSON" in OutputCheck(anything).failure('{"a": NaN}', "stop")
    assert "not JSON" in OutputCheck(anything).failure("Infinity", "stop")


def test_the_check_reads_the_schema_s_own_draft():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
              "maximum": 5, "exclusiveMaximum": True}  # fmt: skip
    assert OutputCheck(draft4).failure("4", "stop") is None
    assert "validation" in OutputCheck(draft4).failure("5", "stop")
    items_array = {"type": "array", "items": [{"type": "string"}]}  # 2019-09 spelling
    assert OutputCheck(items_array).failure('["a"]', "stop") is None
    assert OutputCheck(items_array).failure("[1]", "stop") is not None


def test_strict_constraints_carry_the_check_and_non_strict_do_not():
    strict = parse_constraint({"guided_json": POINT})
    assert strict is not None and strict.check == OutputCheck(POINT)
    loose = parse_constraint({"response_format": {"type": "json_schema", "json_schema": {
        "schema": POINT, "strict": False}}})  # fmt: skip
    assert loose is not None and loose.check is None


class _DoneStream:
    """A request stream whose deltas all came already (merged() reads none from it)."""

    finished = True
    request_id = "r"

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration


def _events(text: str, check) -> list[dict]:
    builder = ResponseBuilder("m", None)
    req = GenerationRequest(prompts=["p"], params=SamplingParams(), stream=True)
    choice = Choice(0, _DoneStream())  # type: ignore[arg-type]
    first = Delta("r", [1], finish_reason="stop", text=text)
    choice.add(first)

    async def collect() -> list[dict]:
        return [e async for e in builder.events(req, [choice], [first], False, check)]

    return asyncio.run(collect())


def test_a_streamed_output_that_fails_ends_in_an_error_event_not_a_stop():
    def check(choice: Choice) -> str | None:
        return OutputCheck(POINT).failure(choice.text, choice.finish_reason)

    good = _events('{"x":1}', check)
    assert good[-1]["choices"][0]["finish_reason"] == "stop"
    bad = _events('{"x":"a"}', check)
    assert "error" in bad[-1] and "schema validation" in bad[-1]["error"]["message"]
    assert not any(c.get("finish_reason") == "stop" for e in bad for c in e.get("choices", []))


def test_generic_tool_calls_parse_from_the_whole_answer():
    parser = GenericToolParser()
    content, calls = parser.parse('{"tool_calls":[{"name":"f","arguments":{"a":1}}]}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a":1}')]
    _, calls = parser.parse('```json\n{"tool_call": {"name": "g", "arguments": "{}"}}```')
    assert [c.name for c in calls] == ["g"]
    assert parser.parse("It is sunny.") == ("It is sunny.", [])
    assert parser.parse('{"answer": 3}') == ('{"answer": 3}', [])  # JSON, but no call


def test_auto_tools_without_a_native_template_get_the_generic_note():
    tools = ToolRequest([{"name": "f", "parameters": {"type": "object"}}], "auto")
    messages, template_tools = prepare_chat([{"role": "user", "content": "hi"}], tools, False)
    assert template_tools is None
    assert messages[0]["role"] == "system" and '"tool_calls"' in messages[0]["content"]
    assert '"name":"f"' in messages[0]["content"]
