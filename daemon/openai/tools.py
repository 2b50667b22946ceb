"""OpenAI tool calling: `tools` + `tool_choice` in, `message.tool_calls` out.

```
tool_choice  | what the model may write                  | how it becomes tool_calls
-------------+-------------------------------------------+-------------------------------
"none"       | anything; tools are not shown to it       | never
"required"   | {"name": <a tool>, "arguments": {...}}     | the JSON, through a JSON-schema
named        | {"name": <that tool>, "arguments": {...}}  |   constraint (grammars/)
"auto"       | anything; the chat template shows tools   | the model's tool parser
```
"auto" needs a chat template that renders `tools`; otherwise it answers 400.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from daemon.openai.generic_tools import generic_tools_note
from daemon.openai.output_check import OutputCheck
from daemon.openai.protocol import APIError
from daemon.openai.structured_output import Constraint, parse_constraint, schema_spec
from daemon.openai.tool_parsers import ParsedToolCall, ToolParser, parse_call_json

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(slots=True)
class ToolRequest:
    """The tools of a chat request and how the model must use them."""

    # The `function` objects as sent (name, description, parameters).
    functions: list[dict[str, Any]]
    mode: ToolMode
    # required / named: the JSON-schema constraint that forces a call.
    constraint: Constraint | None = None
    # Where the calls come from: the forced JSON, or the parser's reading of the text.
    call_ids: dict[int, str] = field(default_factory=dict)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def parse_output_rules(
    body: dict[str, Any], chat: bool
) -> tuple[Constraint | None, ToolRequest | None]:
    """The request's one output constraint (a forced tool call counts) and its tools."""
    constraint = parse_constraint(body)
    tools = parse_tools(body) if chat else None
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise APIError(
                400,
                f"tool_choice, {constraint.param}: only one output constraint per request",
                "tool_choice",
            )
        constraint = tools.constraint
    return constraint, tools


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """`tools` and `tool_choice` of a chat body, validated; None when no tools."""
    tools = body.get("tools")
    if tools in (None, []):
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools: expected an array", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400, f"tools[{i}]: expected {{type: function, function: {{...}}}}", "tools"
            )
        if not isinstance(fn.get("name"), str) or not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,64}", fn["name"]
        ):
            raise APIError(
                400, f"tools[{i}].function.name: expected 1-64 of [A-Za-z0-9_.-]", "tools"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters: expected an object", "tools")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", "tools")
    choice = body.get("tool_choice", "auto")
    if choice in ("none", "auto", "required"):
        mode: ToolMode = choice
        allowed = functions
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        allowed = [f for f in functions if f["name"] == name]
        if not allowed:
            raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        mode = "named"
    else:
        raise APIError(
            400, 'tool_choice: expected "none", "auto", "required" or a named function',
            "tool_choice",
        )  # fmt: skip
    req = ToolRequest(functions, mode)
    if req.forced:
        req.constraint = _call_constraint(allowed)
    return req


def _call_constraint(functions: list[dict[str, Any]]) -> Constraint:
    """{"name": <one of them>, "arguments": <its parameters>}; name first, so it streams first."""
    branches = []
    warnings: list[str] = []
    all_strict = True
    for i, fn in enumerate(functions):
        strict = fn.get("strict") is not False
        all_strict &= strict
        checked = schema_spec(fn["parameters"], strict, f"tools[{i}].function.parameters")
        warnings += checked.warnings
        # A strict schema passed as sent (normalised once, below); else what was kept of it.
        params = fn["parameters"] if strict else orjson.loads(checked.spec.text)
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
            }
        )
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    out = schema_spec(schema, False, "tools")
    return Constraint(out.spec, "tools", warnings, OutputCheck(schema) if all_strict else None)


# -- the prompt ---------------------------------------------------------------------------


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows `tools` to the model (rendering changes with them)."""
    probe = [{"role": "user", "content": "x"}]
    tool = [{"type": "function", "function": {"name": "probe_tool", "parameters": {}}}]
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=tool, tokenize=False)
    except Exception:
        return False
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False)


def prepare_chat(
    messages: list[dict[str, Any]], tools: ToolRequest | None, renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and `tools` for the chat template.

    A template that renders tools gets them (and tool calls as it expects them). One that
    does not gets the history as text: past calls as `<tool_call>` blocks, and for a forced
    call a system note that lists the tools.
    """
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls and renders_tools:
            m["tool_calls"] = [_template_call(c) for c in calls]
        elif calls:
            text = "".join(f"<tool_call>{_call_text(c)}</tool_call>" for c in calls)
            m["content"] = (m.get("content") or "") + text
        if m.get("content") is None:
            m["content"] = ""
        if not renders_tools:
            m.pop("tool_call_id", None)
        out.append(m)
    if tools is None or tools.mode == "none":
        return out, None
    template_tools = [{"type": "function", "function": f} for f in tools.functions]
    if renders_tools:
        return out, template_tools
    if tools.mode == "auto":
        # No native format: the generic one (daemon/openai/generic_tools.py), read back by
        # its parser.
        note = generic_tools_note(tools.functions)
    else:
        note = (
            "You can call these functions. Answer with one call as JSON "
            '{"name": ..., "arguments": {...}}.\n' + orjson.dumps(tools.functions).decode()
        )
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out, None


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = fn.get("arguments") or "{}"
    return orjson.dumps({"name": fn["name"], "arguments": orjson.loads(args)}).decode()


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    # HF templates take arguments as a mapping.
    return {
        **call,
        "function": {"name": fn["name"], "arguments": orjson.loads(fn.get("arguments") or "{}")},
    }


# -- the response -------------------------------------------------------------------------


def call_dict(call: ParsedToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def rewrite_message(choice: dict[str, Any], tools: ToolRequest, parser: ToolParser | None) -> None:
    """Turn a finished chat choice's text into `tool_calls` (in place) where it holds calls."""
    message = choice["message"]
    text = message.get("content") or ""
    if tools.forced:
        call = parse_call_json(text)
        content, calls = (None, [call]) if call else (text, [])
    elif tools.mode == "auto" and parser is not None:
        content, calls = parser.parse(text)
    else:
        return
    if calls:
        message["content"] = content
        message["tool_calls"] = [call_dict(c) for c in calls]
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"


_CALL_HEAD = re.compile(r'\{"name":"((?:[^"\\]|\\.)*)","arguments":')


class _ForcedCallStream:
    """One choice's forced call as `delta.tool_calls` chunks: id and name, then arguments.

    The constrained output is `{"name":"f","arguments":<args>}` (compact: the grammar fixes
    the separators), so the arguments are the text after the head, less the final `}`.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.sent = 0  # characters of arguments sent
        self.head_len: int | None = None

    def feed(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        self.buffer += text
        out: list[dict[str, Any]] = []
        if self.head_len is None:
            m = _CALL_HEAD.match(self.buffer)
            if m is None:
                return out
            self.head_len = m.end()
            name = orjson.loads(f'"{m.group(1)}"')
            out.append(
                {
                    "index": 0,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        args = self.buffer[self.head_len :]
        # The last character may be the wrapper's closing brace: hold it back until the end,
        # then drop it if the output completed ("length" leaves no brace to drop).
        end = len(args) - (1 if finish_reason in (None, "stop") else 0)
        if end > self.sent:
            out.append({"index": 0, "function": {"arguments": args[self.sent : end]}})
            self.sent = end
        return out


async def stream_tool_calls(
    events: AsyncIterator[dict[str, Any]], tools: ToolRequest, parser: ToolParser | None
) -> AsyncIterator[dict[str, Any]]:
    """Rewrite chat chunks so calls arrive as `delta.tool_calls` in OpenAI's shape.

    Forced calls stream as they are generated. With "auto" the text is held until its
    choice finishes, then sent as content or as tool calls (the parser needs all of it).
    """
    forced: dict[int, _ForcedCallStream] = {}
    held: dict[int, str] = {}
    async for payload in events:
        for item in payload.get("choices", []):
            delta = item.get("delta")
            if delta is None or "role" in delta:
                continue
            idx, text, done = item["index"], delta.pop("content", ""), item["finish_reason"]
            if tools.forced:
                stream = forced.setdefault(idx, _ForcedCallStream())
                calls = stream.feed(text, done)
                if calls:
                    delta["tool_calls"] = calls
                if done == "stop" and stream.head_len is not None:
                    item["finish_reason"] = "tool_calls"
            else:
                held[idx] = held.get(idx, "") + text
                if done is not None:
                    content, calls = parser.parse(held.pop(idx)) if parser else (None, [])
                    if calls:
                        delta["tool_calls"] = [
                            {"index": i, **call_dict(c)} for i, c in enumerate(calls)
                        ]
                        if done == "stop":
                            item["finish_reason"] = "tool_calls"
                    if content:
                        delta["content"] = content
        yield payload
