"""`not` of the simple forms, as a normal-form schema of what remains."""

from __future__ import annotations

from typing import Any

from grammars.schema.merge import NF, any_of

_ALL = ("null", "boolean", "object", "array", "number", "string")
_IGNORED = frozenset({"title", "description", "$comment"})


def complement(sub: Any) -> NF | None:
    """What `not: sub` allows, for `sub` a type (list), a const or an enum; else None.

    `not: {"type": "integer"}` also leaves out every number: "a number that is not whole"
    has no normal form, and narrowing is safe.
    """
    if not isinstance(sub, dict):
        return None
    keys = set(sub) - _IGNORED
    if keys == {"type"}:
        types = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
        if "integer" in types:
            types = [*types, "number"]
        return any_of([{"type": t} for t in _ALL if t not in types])
    if keys == {"const"} or keys == {"enum"}:
        values = [sub["const"]] if "const" in sub else sub["enum"]
        if not isinstance(values, list):
            return None
        return any_of([_without(t, [v for v in values if _type_of(v) == t]) for t in _ALL])
    return None


def _without(kind: str, values: list[Any]) -> NF:
    return {"type": kind, "not": {"enum": values}} if values else {"type": kind}


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
