"""The request fields that constrain the output, read into one GrammarSpec.

Accepted (one per request; two answer 400):
- `response_format`: {"type": "text"} | {"type": "json_object"} |
  {"type": "json_schema", "json_schema": {"name", "schema", "strict" (default true)}}
- vLLM's extensions: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  and `structured_outputs: {"json" | "regex" | "choice" | "grammar"}`
A JSON Schema keyword the compiler does not enforce answers 400 when strict; with
`strict: false` it is dropped and named in the `X-Headrace-Warning` response header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from daemon.openai.output_check import OutputCheck
from daemon.openai.protocol import APIError
from grammars import GrammarError, GrammarSpec

WARNING_HEADER = "X-Headrace-Warning"
# Deeper schemas answer 400 before any recursive code (a copy, the compiler) sees them:
# ~300 levels ran Python out of recursion in deepcopy (a 500). Real schemas nest < 20.
MAX_SCHEMA_DEPTH = 64


def schema_depth(value: Any, limit: int) -> int:
    """How deeply objects and arrays nest in `value`, counted without recursion and
    given up past `limit` (returns limit + 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass(slots=True)
class Constraint:
    """The grammar a request asked for, the field it came from, and what was dropped."""

    spec: GrammarSpec
    param: str
    warnings: list[str] = field(default_factory=list)
    # Strict json_schema constraints: the output is validated before it counts as success.
    check: OutputCheck | None = None


def schema_spec(schema: Any, strict: bool, param: str) -> Constraint:
    """A json_schema constraint after the strict rule (see grammars/schema_support.py)."""
    if schema_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise APIError(400, f"{param}: nested deeper than {MAX_SCHEMA_DEPTH} levels", param)
    try:
        spec, dropped = GrammarSpec.checked_json_schema(schema, strict)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param) from None
    warnings = [f"{param}: not enforced, dropped: {where}" for where in dropped]
    if isinstance(schema, str):
        schema = orjson.loads(schema)  # parsed fine above
    return Constraint(spec, param, warnings, OutputCheck(schema) if strict else None)


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The one output constraint in `body`, or None; APIError(400) naming the field."""
    found: list[Constraint] = []
    rf = body.get("response_format")
    if rf is not None and (c := _response_format(rf)):
        found.append(c)
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append(_one(kind, body[key], key))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs: expected an object", "structured_outputs")
        unknown = sorted(set(so) - _STRUCTURED_OUTPUT_KEYS)
        if unknown:
            keys = ", ".join(sorted(_STRUCTURED_OUTPUT_KEYS))
            raise APIError(
                400,
                f"structured_outputs: unknown key(s) {', '.join(unknown)} (expected one of {keys})",
                "structured_outputs",
            )
        for kind in ("json", "regex", "choice", "grammar"):
            if so.get(kind) is not None:
                found.append(_one(kind, so[kind], f"structured_outputs.{kind}"))
        if so.get("json_object"):
            found.append(Constraint(GrammarSpec("json"), "structured_outputs.json_object"))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise APIError(400, f"{names}: only one output constraint per request", found[1].param)
    return found[0] if found else None


_STRUCTURED_OUTPUT_KEYS = frozenset({"json", "regex", "choice", "grammar", "json_object"})
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _one(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        return schema_spec(value, True, param)
    if kind == "choice":
        try:
            return Constraint(GrammarSpec.choice(value), param)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param) from None
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: expected a non-empty string", param)
    return Constraint(GrammarSpec(kind, value), param)  # type: ignore[arg-type]


def _response_format(rf: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError(400, f"{param}: expected an object with a type", param)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(GrammarSpec("json"), param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(400, f"{param}.json_schema: expected an object with a schema", param)
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, f"{param}.json_schema.strict: expected a boolean", param)
        return schema_spec(js["schema"], strict is not False, f"{param}.json_schema.schema")
    raise APIError(
        400, f"{param}.type: expected text, json_object or json_schema, got {kind!r}", param
    )
