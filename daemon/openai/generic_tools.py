"""Tool calls for models whose chat template cannot render tools (as llama.cpp's server does).

The tools go into a system note that asks for one JSON object when the model calls any:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}

and anything else is a plain answer. `GenericToolParser` reads that object (also a single
`{"tool_call": {...}}` or a bare `{"name": ..., "arguments": ...}`) from the finished text.
"""

from __future__ import annotations

from typing import Any

import orjson

from daemon.openai.tool_parsers import ParsedToolCall

_NOTE = (
    "You can call the functions listed below. To call one or more, answer with only a JSON "
    'object: {"tool_calls": [{"name": <function name>, "arguments": {<its arguments>}}]}. '
    "Otherwise answer normally, in plain text.\n"
)


def generic_tools_note(functions: list[dict[str, Any]]) -> str:
    """The system note that lists the tools and the call format."""
    return _NOTE + orjson.dumps(functions).decode()


class GenericToolParser:
    """Reads the generic JSON call format from a whole answer; plain text stays content."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = _strip_fence(text.strip())
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict):
            return text, []
        if isinstance(obj.get("tool_calls"), list):
            raw = obj["tool_calls"]
        elif isinstance(obj.get("tool_call"), dict):
            raw = [obj["tool_call"]]
        else:
            raw = [obj]
        calls = [c for c in (_call(r) for r in raw) if c is not None]
        if len(calls) != len(raw) or not calls:
            return text, []
        return None, calls


def _call(raw: Any) -> ParsedToolCall | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    args = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments JSON-encoded
        try:
            args = orjson.loads(args)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(raw["name"], orjson.dumps(args).decode())


def _strip_fence(text: str) -> str:
    """The body of a ```json fenced block, which small models like to write."""
    if text.startswith("```") and text.endswith("```"):
        text = text[3:-3]
        return text[4:] if text.startswith("json") else text
    return text
