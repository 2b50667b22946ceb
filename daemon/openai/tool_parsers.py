"""Tool-call parsers for `tool_choice: "auto"`: model text -> content and tool calls.

Each model family writes its calls its own way; a parser registers under the
`headrace.tool_parsers` entry-point group (the built-in one, `hermes`, too) and declares
`api_version = TOOL_PARSER_API_VERSION`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import orjson

from plugins import load_plugin

TOOL_PARSER_GROUP = "headrace.tool_parsers"
TOOL_PARSER_API_VERSION = 1


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call the model made: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


@runtime_checkable
class ToolParser(Protocol):
    """Splits a finished assistant message into plain content and tool calls."""

    name: ClassVar[str]
    api_version: ClassVar[int]

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]: ...


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen and Hermes write.

    A block that is not a JSON object with a string name stays in the content.
    """

    name: ClassVar[str] = "hermes"
    api_version: ClassVar[int] = TOOL_PARSER_API_VERSION
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls: list[ParsedToolCall] = []
        kept: list[str] = []
        last = 0
        for m in self._BLOCK.finditer(text):
            call = parse_call_json(m.group(1))
            kept.append(text[last : m.start()] if call else text[last : m.end()])
            last = m.end()
            if call:
                calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls


def parse_call_json(text: str) -> ParsedToolCall | None:
    """{"name": str, "arguments": object} -> ParsedToolCall, else None."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], orjson.dumps(args).decode())


def load_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name` in `headrace.tool_parsers`."""
    cls = load_plugin(TOOL_PARSER_GROUP, name, TOOL_PARSER_API_VERSION, "tool parser")
    parser = cls()
    if not isinstance(parser, ToolParser):
        raise TypeError(f"tool parser {name!r} has no parse(text) method")
    return parser
