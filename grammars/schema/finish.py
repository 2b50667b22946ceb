"""Normal form -> the schema xgrammar compiles, with the same meaning (or refused).

xgrammar full-matches patterns, lets a listed name through `additionalProperties` when
`patternProperties` are there too, ignores `not`, `uniqueItems`, lengths next to a pattern
and multipleOf next to a range, and cannot compile a `false` subschema. Each rewrite below
keeps the meaning exactly: patterns become full-match patterns, a forbidden name is kept out
of `additionalProperties` by a pattern for every other name, exclusions become ranges or
patterns, `uniqueItems` over a small finite item set and a bounded multipleOf become enums.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import TYPE_CHECKING, Any

import orjson

from grammars.schema.formats import FORMAT_LENGTHS, FORMAT_PATTERNS
from grammars.schema.merge import NF, any_of
from grammars.schema.regex import PatternError, full_match_pattern, not_any_of, optional_groups

if TYPE_CHECKING:
    from grammars.schema.normalize import Normalizer

# uniqueItems is enforced by listing the arrays: at most this many.
MAX_UNIQUE_ARRAYS = 512
# An integer range this small counts as a finite item set for uniqueItems.
MAX_FINITE_RANGE = 16
# xgrammar ignores multipleOf next to a range: a bounded one is listed, up to this many values.
MAX_MULTIPLES = 256


def finish(nf: NF, norm: Normalizer, path: str) -> NF:
    """`nf` and everything under it in xgrammar's terms (SchemaRefusal via norm.policy)."""
    if not isinstance(nf, dict) or nf == {} or "enum" in nf or "$ref" in nf:
        return nf
    if "anyOf" in nf:
        return any_of([finish(b, norm, f"{path}/anyOf/{i}") for i, b in enumerate(nf["anyOf"])])
    node = dict(nf)
    for key in ("items", "additionalProperties", "propertyNames"):
        if key in node:
            node[key] = finish(node[key], norm, f"{path}/{key}")
    if "prefixItems" in node:
        node["prefixItems"] = [
            finish(s, norm, f"{path}/prefixItems/{i}") for i, s in enumerate(node["prefixItems"])
        ]
    for key in ("properties", "patternProperties"):
        if key in node:
            node[key] = {k: finish(s, norm, f"{path}/{key}/{k}") for k, s in node[key].items()}
    kind = node["type"]
    if "not" in node:
        excluded = node.pop("not")["enum"]
        if kind in ("object", "array"):
            norm.policy.refuse("not", path, f"excluding {kind} values is not enforced")
        else:  # no subschemas: finishing the result again finishes nothing twice
            return finish(_exclude(node, excluded, norm, path), norm, path)
    if kind == "string":
        return _string(node, norm, path)
    if kind == "integer" and "multipleOf" in node and ({"minimum", "maximum"} & set(node)):
        return _bounded_multiples(node, norm, path)
    if kind == "object":
        return _object(node, norm, path)
    if kind == "array":
        return _array(node, norm, path)
    return node


def _bounded_multiples(node: dict[str, Any], norm: Normalizer, path: str) -> NF:
    step, low, high = node["multipleOf"], node.get("minimum"), node.get("maximum")
    if low is None or high is None or (high - low) // step > MAX_MULTIPLES:
        norm.policy.refuse("multipleOf", path, f"multipleOf next to a range is enforced for at "
                           f"most {MAX_MULTIPLES} values")  # fmt: skip
        node.pop("multipleOf")
        return node
    first = -(-low // step) * step
    values = list(range(first, high + 1, step))
    return {"enum": values} if values else False


def _exclude(node: dict[str, Any], values: list[Any], norm: Normalizer, path: str) -> NF:
    """`node` without `values` (all of the node's own type)."""
    kind = node["type"]
    if kind in ("null", "boolean"):
        kept = [v for v in ([None] if kind == "null" else [True, False]) if v not in values]
        return {"enum": kept} if kept else False
    if kind in ("integer", "number"):
        return _cut_ranges(node, [v for v in values if not isinstance(v, bool)], norm, path)
    if kind == "string" and not set(node) & {"pattern", "format", "minLength", "maxLength"}:
        return {**node, "pattern": not_any_of(values)}
    norm.policy.refuse("not", path, f"excluding values from a constrained {kind} is not enforced")
    return node


def _cut_ranges(node: dict[str, Any], values: list[Any], norm: Normalizer, path: str) -> NF:
    """An integer node split into ranges around each excluded whole number."""
    low, high = node.get("minimum", -math.inf), node.get("maximum", math.inf)
    cuts = sorted({int(v) for v in values if float(v).is_integer() and low <= v <= high})
    if node["type"] == "number":
        if any(low <= v <= high for v in values):
            norm.policy.refuse("not", path, "excluding values from numbers is not enforced")
        return node
    pieces, start = [], low
    for v in [*cuts, high + 1]:
        piece = {k: x for k, x in node.items() if k not in ("minimum", "maximum")}
        if start != -math.inf:
            piece["minimum"] = start
        if v != math.inf:
            piece["maximum"] = v - 1
        if start <= v - 1:
            pieces.append(piece)
        start = v + 1
    return any_of(pieces)


def _string(node: dict[str, Any], norm: Normalizer, path: str) -> NF:
    fmt = node.pop("format", None)
    if fmt is not None:
        if "pattern" in node:
            norm.policy.refuse("format", path, "format together with pattern is not enforced")
        else:
            node["pattern"] = FORMAT_PATTERNS[fmt]
            shortest, longest = FORMAT_LENGTHS.get(fmt, (None, None))
            if shortest is not None and node.get("minLength", 0) <= shortest:
                node.pop("minLength", None)
            if longest is not None and node.get("maxLength", math.inf) >= longest:
                node.pop("maxLength", None)
    if "pattern" in node:
        if "minLength" in node or "maxLength" in node:
            norm.policy.refuse("maxLength", path, "lengths together with a pattern or format "
                               "are not enforced")  # fmt: skip
            node.pop("minLength", None)
            node.pop("maxLength", None)
        try:
            node["pattern"] = full_match_pattern(node["pattern"])
        except PatternError as e:
            norm.policy.refuse("pattern", path, str(e))
            node.pop("pattern")
    if node.get("minLength", 0) > node.get("maxLength", math.inf):
        return False
    return node


def _object(node: dict[str, Any], norm: Normalizer, path: str) -> NF:
    props: dict[str, NF] = node.pop("properties", {})
    patterns: dict[str, NF] = node.pop("patternProperties", {})
    required: list[str] = node.get("required", [])
    names = node.get("propertyNames")
    for name in required:
        if name not in props:
            props[name] = _value_for(name, patterns, node)
    forbidden = {n for n, s in props.items() if s is False}
    if names is not None:
        forbidden |= {n for n in props if not norm.valid(n, names)}
    if forbidden & set(required):
        return False
    props = {n: s for n, s in props.items() if n not in forbidden}
    extra = node.pop("additionalProperties", None)
    if any(s is False for s in patterns.values()) and extra not in (None, False):
        norm.policy.refuse("patternProperties", path, "a false pattern next to "
                           "additionalProperties is not enforced")  # fmt: skip
    patterns = _full_patterns({p: s for p, s in patterns.items() if s is not False}, norm, path)
    if len(patterns) > 1:
        first = next(iter(patterns.values()))
        if any(s != first for s in patterns.values()):
            norm.policy.refuse("patternProperties", path, "several patterns with different "
                               "schemas are not enforced")  # fmt: skip
        # Full-match patterns are ^(...)$: their bodies join as alternatives.
        patterns = {"^(" + "|".join(p[1:-1] for p in patterns) + ")$": first}
    for name in props:
        for pattern, sub in patterns.items():
            if re.search(pattern, name) and norm.merge(props[name], sub, path) != sub:
                norm.policy.refuse("patternProperties", path, f"a pattern matching the "
                                   f"property {name!r} is not enforced")  # fmt: skip
    if isinstance(names, dict) and "enum" in names and (props or patterns):
        for name in names["enum"]:
            if isinstance(name, str) and name not in props and name not in forbidden:
                props[name] = _value_for(name, patterns, {"additionalProperties": extra})
        patterns, extra = {}, False
        node.pop("propertyNames")
    elif names is not None and (props or patterns):
        norm.policy.refuse("propertyNames", path, "propertyNames next to properties is only "
                           "enforced as an enum")  # fmt: skip
        node.pop("propertyNames")
    if extra not in (None, False) and patterns:
        norm.policy.refuse("additionalProperties", path, "additionalProperties next to "
                           "patternProperties is not enforced")  # fmt: skip
        extra = None
    if extra not in (None, False) and forbidden:
        # The forbidden names must not come back through `additionalProperties`.
        patterns, extra = {optional_groups(not_any_of([*props, *forbidden])): extra}, None
    if props:
        node["properties"] = props
    if patterns:
        node["patternProperties"] = patterns
    if extra is not None:
        node["additionalProperties"] = extra
    return node


def _value_for(name: str, patterns: dict[str, NF], node: dict[str, Any]) -> NF:
    for pattern, sub in patterns.items():
        if re.search(pattern, name):
            return sub
    extra = node.get("additionalProperties")
    return {} if extra is None else extra


def _full_patterns(patterns: dict[str, NF], norm: Normalizer, path: str) -> dict[str, NF]:
    out = {}
    for pattern, sub in patterns.items():
        try:
            out[full_match_pattern(pattern)] = sub
        except PatternError as e:
            norm.policy.refuse("patternProperties", path, str(e))
    return out


def _array(node: dict[str, Any], norm: Normalizer, path: str) -> NF:
    prefix = node.get("prefixItems", [])
    if False in prefix:
        cut = prefix.index(False)
        node["prefixItems"], node["maxItems"] = prefix[:cut], min(node.get("maxItems", cut), cut)
        prefix = node["prefixItems"]
    if node.get("minItems", 0) > node.get("maxItems", math.inf):
        return False
    if prefix and node.get("minItems", 0) > len(prefix) and "items" not in node:
        node["items"] = {}  # absent items allow anything; xgrammar reads it as none
    if node.pop("uniqueItems", False) and node.get("maxItems", math.inf) > 1:
        return _unique(node, norm, path)
    if not prefix:
        node.pop("prefixItems", None)
    return node


def _unique(node: dict[str, Any], norm: Normalizer, path: str) -> NF:
    """uniqueItems over a small finite item set: the enum of every such array."""
    values = None if node.get("prefixItems") else _finite(node.get("items", {}), norm)
    if values is None:
        norm.policy.refuse("uniqueItems", path, "uniqueItems is enforced only for items from a "
                           "small finite set (enum, boolean, small integer range)")  # fmt: skip
        return node
    low, high = node.get("minItems", 0), min(node.get("maxItems", len(values)), len(values))
    arrays: list[list[Any]] = []
    for n in range(low, high + 1):
        for combo in itertools.permutations(values, n):
            arrays.append(list(combo))
            if len(arrays) > MAX_UNIQUE_ARRAYS:
                norm.policy.refuse("uniqueItems", path, f"more than {MAX_UNIQUE_ARRAYS} "
                                   "arrays of unique items")  # fmt: skip
                return node
    return {"enum": arrays} if arrays else False


def _finite(items: NF, norm: Normalizer) -> list[Any] | None:
    """The distinct values `items` allows, if it allows few; None otherwise."""
    if isinstance(items, dict) and "enum" in items:
        values = items["enum"]
    elif items == {"type": "boolean"}:
        values = [True, False]
    elif items == {"type": "null"}:
        values = [None]
    elif isinstance(items, dict) and items.get("type") == "integer":
        low, high = items.get("minimum"), items.get("maximum")
        if low is None or high is None or high - low >= MAX_FINITE_RANGE:
            return None
        values = [v for v in range(low, high + 1) if norm.valid(v, items)]
    else:
        return None
    seen: dict[bytes, Any] = {}
    for v in values:
        # 1 and 1.0 are the same item to a validator (but true is not 1).
        key = orjson.dumps(float(v) if type(v) in (int, float) else v, option=orjson.OPT_SORT_KEYS)
        seen.setdefault(key, v)
    return list(seen.values())
