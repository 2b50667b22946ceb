"""Structured output and tool calls over HTTP: the openai client against the real daemon."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(daemon) -> str:
    return httpx.get(f"{daemon.url}/v1/models").json()["data"][0]["id"]


def post(daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{daemon.url}{path}", json=body, timeout=120)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


def test_response_format_and_guided_fields_on_both_endpoints(daemon, client, model):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=40, temperature=0, response_format=fmt
    )
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    any_json = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=60, response_format={"type": "json_object"},
        temperature=0,
    )  # fmt: skip
    if any_json.choices[0].finish_reason == "stop":
        json.loads(any_json.choices[0].message.content)
    extras = [
        ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"guided_grammar": 'root ::= "a" [0-9] "b"'}, lambda t: re.fullmatch(r"a\db", t)),
        ({"structured_outputs": {"regex": "(yes|no)"}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ]
    for extra, check in extras:
        comp = client.completions.create(
            model=model, prompt="Answer:", max_tokens=40, temperature=0, extra_body=extra
        )
        assert comp.choices[0].finish_reason == "stop", extra
        assert check(comp.choices[0].text), (extra, comp.choices[0].text)
    stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=40, temperature=0, stream=True,
        extra_body={"guided_json": PERSON},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
         "unknown type 'foo'"),
        ({"guided_regex": "[a-"}, "position"),
        ({"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
        ({"guided_choice": []}, "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "only one output constraint"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "array", "contains": {"const": 3}, "minContains": 2}}}},
         "#/minContains"),
        ({"guided_json": {"$ref": "https://json-schema.org/draft/2020-12/schema"}},
         "remote refs are not fetched"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "only one"),
        # Too large to compile at all (the defaults: 64 KiB, 1024 choices), and no sentence.
        ({"guided_choice": ["x" * 1000] * 70}, "guided_choice: choice: all choices together"),
        ({"guided_choice": ["x"] * 1025}, "guided_choice: choice: 1025 choices"),
        ({"guided_regex": "a" * 70_000}, "guided_regex: regex: the pattern is 70000 bytes"),
        ({"guided_grammar": 'root ::= x\nx ::= x "a"'}, "no finite sentence"),
    ],
)  # fmt: skip
def test_bad_constraints_answer_400_naming_the_problem(daemon, body, needle):
    r = post(daemon, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    if needle.startswith("guided_"):
        assert r.json()["error"]["param"] == needle.split(":")[0]


def test_daemon_keeps_serving_after_bad_grammars_and_frees_every_block(daemon, client, model):
    for _ in range(3):
        assert (
            post(daemon, "/v1/completions", {"prompt": "x", "guided_regex": "(("}).status_code
            == 400
        )
    comp = client.completions.create(
        model=model, prompt="Say", max_tokens=5, temperature=0, extra_body={"guided_regex": "ok"}
    )
    assert comp.choices[0].text == "ok"
    assert daemon.metric("headrace_kv_cache_usage") == 0
    assert daemon.metric("headrace_grammar_cache_misses_total") >= 1
    assert daemon.metric("headrace_constrained_requests_total") >= 4
    assert daemon.metric("headrace_grammar_compile_seconds_count") >= 1
    assert "KV cache check failed" not in daemon.log.read_text()


def test_strict_false_drops_unenforced_keywords_and_says_so(daemon):
    schema = {"type": "integer", "minimum": 0, "maximum": 9, "not": {"minimum": 5}}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": False}}
    body = {"messages": ASK, "max_tokens": 5, "temperature": 0, "response_format": fmt}
    r = post(daemon, "/v1/chat/completions", body)
    assert r.status_code == 200
    assert "#/not" in r.headers["X-Headrace-Warning"]
    assert 0 <= int(r.json()["choices"][0]["message"]["content"]) <= 9


def _check_call(call, names=("get_weather", "get_time")) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_calls_required_and_named_non_streaming_then_follow_up(client, model, choice):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=60, temperature=0,
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    names = ("get_weather",) if isinstance(choice, dict) else ("get_weather", "get_time")
    _check_call(call, names)
    follow = client.chat.completions.create(
        model=model,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        tools=[WEATHER, TIME], tool_choice="none", max_tokens=20, temperature=0,
    )  # fmt: skip
    assert follow.choices[0].message.content
    assert not follow.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_tool_calls_streaming_in_openai_shape(client, model, choice):
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=60, temperature=0, stream=True,
    )  # fmt: skip
    pieces = [c.choices[0] for c in stream if c.choices]
    deltas = [t for p in pieces for t in (p.delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2  # arguments arrive in fragments
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS[first.function.name])
    if isinstance(choice, dict):
        assert first.function.name == "get_time"
    assert pieces[-1].finish_reason == "tool_calls"
    assert not any(p.delta.content for p in pieces)


def test_tool_choice_none_ignores_tools_and_bad_history_is_400(daemon, client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    bad = [*ASK, {"role": "tool", "content": "21"}]  # no tool_call_id
    assert post(daemon, "/v1/chat/completions", {"messages": bad}).status_code == 400


def test_auto_tools_without_a_native_template_answer_with_the_generic_format(daemon, client, model):
    # The embedded model's template cannot render tools: the generic prompt stands in.
    chat = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0
    )
    choice = chat.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.function.name == "get_weather"


def test_strict_outputs_never_fail_the_safety_net(daemon, client, model):
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
              "n": {"type": "integer", "not": {"const": 3}, "minimum": 0, "maximum": 5}},
              "required": ["when", "n"], "additionalProperties": False}  # fmt: skip
    for stream in (False, True):
        out = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=40, temperature=1.0, stream=stream, n=1,
            extra_body={"guided_json": schema, "seed": 3},
        )  # fmt: skip
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        else:
            text = out.choices[0].message.content
        if text.endswith("}"):
            jsonschema.validate(json.loads(text), schema)
    assert daemon.metric("headrace_grammar_validation_failures_total") == 0
