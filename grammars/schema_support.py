"""JSON Schema keywords the compiler does not enforce, in one place, and the strict rule.

Found by probing xgrammar 0.2.9 (tests/test_grammar_schema_support.py pins every entry: the
compiled grammar accepts an instance that the keyword forbids). A keyword listed here is
never silently ignored: with `strict` the request is refused naming it; without, it is
dropped and the response says so.
"""

from __future__ import annotations

import copy
from typing import Any

# keyword -> why it is not enforced (xgrammar 0.2.9).
UNENFORCED_KEYWORDS: dict[str, str] = {
    "not": "negation is not supported",
    "if": "conditional subschemas (if/then/else) are not enforced",
    "contains": "array 'contains' is not enforced",
    "contentEncoding": "content keywords are not enforced",
    "contentMediaType": "content keywords are not enforced",
    "contentSchema": "content keywords are not enforced",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "recursive references are not supported",
}
# Dropped together with their keyword.
_COMPANIONS = {"if": ("then", "else"), "contains": ("minContains", "maxContains")}

# String formats the compiler turns into a pattern; any other format is not enforced.
ENFORCED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "duration",
        "uri",
        "uri-reference",
        "uri-template",
        "ipv4",
        "ipv6",
        "uuid",
        "hostname",
        "json-pointer",
        "relative-json-pointer",
    }
)

# Formats the compiler enforces too loosely (it accepts 2023-02-31 and 1.02.3.4): they are
# compiled as these exact patterns instead. (date-time has the same date problem and is
# treated as not enforced.)
_YEAR = "[0-9]{4}"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": (
        f"^({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
        f"|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])"
        f"|{_LEAP}-02-29)$"
    ),
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
}

# Keywords whose value is one subschema / a map of subschemas / a list of subschemas.
_SUB_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties",
            "unevaluatedItems", "propertyNames", "then", "else", "not", "contains")  # fmt: skip
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced(schema: dict[str, Any]) -> tuple[str, str] | None:
    """The first (keyword, why) this one schema object uses that is not enforced."""
    for keyword, why in UNENFORCED_KEYWORDS.items():
        if keyword in schema:
            return keyword, why
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
        return "format", f"format {fmt!r} is not enforced"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", "allOf with more than one subschema is not enforced"
    if "oneOf" in schema:
        return "oneOf", "oneOf exclusivity is not enforced (use anyOf)"
    if ("pattern" in schema or "format" in schema) and (
        "minLength" in schema or "maxLength" in schema
    ):
        return "maxLength", "string lengths are not enforced together with pattern or format"
    if "multipleOf" in schema and not _integer_multiple_enforced(schema):
        return "multipleOf", "multipleOf is enforced only on integers with both or no bounds"
    return None


def _integer_multiple_enforced(schema: dict[str, Any]) -> bool:
    has_min = "minimum" in schema or "exclusiveMinimum" in schema
    has_max = "maximum" in schema or "exclusiveMaximum" in schema
    return (
        schema.get("type") == "integer"
        and isinstance(schema["multipleOf"], int)
        and has_min == has_max
    )


def check_schema(schema: Any, strict: bool) -> tuple[Any, list[str]]:
    """The schema to compile and the keywords dropped from it.

    strict: raise ValueError naming the first unenforced keyword and where it is.
    Not strict: drop every unenforced keyword (oneOf becomes anyOf) and list them.
    """
    schema = copy.deepcopy(schema)
    dropped: list[str] = []
    _walk(schema, "#", strict, dropped)
    return schema, dropped


def _walk(node: Any, path: str, strict: bool, dropped: list[str]) -> None:
    if not isinstance(node, dict):
        return
    if node.get("format") in FORMAT_PATTERNS and "pattern" not in node:
        node["pattern"] = FORMAT_PATTERNS[node.pop("format")]
    while (found := unenforced(node)) is not None:
        keyword, why = found
        where = f"{path}/{keyword}"
        if strict:
            raise ValueError(
                f"{where}: {why}; remove it or send strict: false to drop it with a warning"
            )
        dropped.append(where)
        if keyword == "oneOf":
            node["anyOf"] = node.pop("oneOf")
        elif keyword == "maxLength":
            node.pop("minLength", None)
            node.pop("maxLength", None)
        elif keyword == "allOf":
            # Keep the first branch: it is enforced; the others are what gets dropped.
            node["allOf"] = node["allOf"][:1]
        else:
            node.pop(keyword)
            for companion in _COMPANIONS.get(keyword, ()):
                node.pop(companion, None)
    for key in _SUB_ONE:
        if key in node:
            _walk(node[key], f"{path}/{key}", strict, dropped)
    for key in _SUB_MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _walk(sub, f"{path}/{key}/{name}", strict, dropped)
    for key in _SUB_LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _walk(sub, f"{path}/{key}/{i}", strict, dropped)
