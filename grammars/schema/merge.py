"""The intersection of two normal-form schemas: what `allOf` (and sibling keywords) mean.

Normal form (NF), what grammars/schema/normalize.py produces:
- `{}` any value; `False` no value
- `{"enum": [...]}` (const too)
- `{"$ref": "#/$defs/<name>"}` into the root's recursive definitions
- `{"anyOf": [NF, ...]}` with two or more branches
- `{"type": T, ...}`: one type and only keywords about it, subschemas in NF;
  `not: {"enum": [...]}` lists values excluded (normalize.finish() removes it)

A merge that would need to intersect two regexes (or two anyOfs too large to multiply out)
raises SchemaRefusal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from grammars.schema.errors import SchemaRefusal

NF = Any
# Branches an anyOf may multiply into when merged with another anyOf.
MAX_BRANCHES = 64
_LOWER = ("minLength", "minItems", "minProperties")
_UPPER = ("maxLength", "maxItems", "maxProperties")


def any_of(branches: list[NF]) -> NF:
    """The union of NF branches, flattened: False if none, the branch if one."""
    out: list[NF] = []
    for b in branches:
        if b is False:
            continue
        if b == {}:
            return {}
        for sub in b.get("anyOf", [b]):
            if sub not in out:
                out.append(sub)
    if not out:
        return False
    return out[0] if len(out) == 1 else {"anyOf": out}


class Merger:
    """Merges NF schemas. `defs` are the root's recursive definitions (NF); `valid(value,
    schema)` says whether a JSON value validates against an NF schema (refs into `defs`)."""

    def __init__(self, defs: dict[str, NF], valid: Callable[[Any, NF], bool]) -> None:
        self.defs = defs
        self.valid = valid

    def merge(self, a: NF, b: NF, path: str, depth: int = 0) -> NF:
        if a is False or b is False:
            return False
        if a == {}:
            return b
        if b == {}:
            return a
        if depth > 8:
            raise SchemaRefusal("$ref", path, "recursive definitions merged too deeply")
        for x, y in ((a, b), (b, a)):
            if "$ref" in x:
                body = self.defs[x["$ref"].rsplit("/", 1)[1]]
                if body is None:
                    raise SchemaRefusal("$ref", path, "a recursive definition merged inside itself")
                return self.merge(body, y, path, depth + 1)
        if "anyOf" in a or "anyOf" in b:
            left = a.get("anyOf", [a])
            right = b.get("anyOf", [b])
            if len(left) * len(right) > MAX_BRANCHES:
                raise SchemaRefusal("anyOf", path, f"more than {MAX_BRANCHES} branches once merged")
            return any_of([self.merge(x, y, path, depth) for x in left for y in right])
        for x, y in ((a, b), (b, a)):
            if "enum" in x:
                kept = [v for v in x["enum"] if self.valid(v, y)]
                return {"enum": kept} if kept else False
        return self._typed(a, b, path)

    def _typed(self, a: dict[str, Any], b: dict[str, Any], path: str) -> NF:
        types = {a["type"], b["type"]}
        if types == {"integer", "number"}:
            a, b = {**a, "type": "integer"}, {**b, "type": "integer"}
        elif len(types) > 1:
            return False
        out: dict[str, Any] = {**a}
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif out[key] != value:
                out[key] = self._keyword(key, out[key], value, a, b, path)
        if out["type"] == "integer":
            _integer_bounds(out)
        if out["type"] == "object":
            self._object(out, a, b, path)
        if out["type"] == "array":
            self._array(out, a, b, path)
        return out

    def _keyword(self, key: str, x: Any, y: Any, a: dict, b: dict, path: str) -> Any:
        if key in _LOWER or key in ("minimum", "exclusiveMinimum"):
            return max(x, y)
        if key in _UPPER or key in ("maximum", "exclusiveMaximum"):
            return min(x, y)
        if key == "multipleOf" and isinstance(x, int) and isinstance(y, int):
            return x * y // math.gcd(x, y)
        if key == "uniqueItems":
            return x or y
        if key == "required":
            return x + [n for n in y if n not in x]
        if key == "not":
            return {"enum": x["enum"] + [v for v in y["enum"] if v not in x["enum"]]}
        if key in ("items", "propertyNames", "additionalProperties"):
            return self.merge(x, y, f"{path}/{key}")
        if key in ("properties", "prefixItems", "patternProperties"):
            return x  # merged by _object / _array, which see both sides
        raise SchemaRefusal(key, path, f"two different {key} values cannot be combined")

    def _object(self, out: dict[str, Any], a: dict, b: dict, path: str) -> None:
        pa, pb = a.get("patternProperties", {}), b.get("patternProperties", {})
        if pa and pb and pa.keys() != pb.keys():
            raise SchemaRefusal("patternProperties", path, "two different sets cannot combine")
        props: dict[str, NF] = {}
        for name in [*a.get("properties", {}), *b.get("properties", {})]:
            if name not in props:
                props[name] = self.merge(_value_for(a, name), _value_for(b, name), path)
        if props:
            out["properties"] = props
        patterns = {
            p: self.merge(pa.get(p, a.get("additionalProperties", {})),
                          pb.get(p, b.get("additionalProperties", {})), path)
            for p in [*pa, *(k for k in pb if k not in pa)]
        }  # fmt: skip
        if patterns:
            out["patternProperties"] = patterns
        if "additionalProperties" in out and out["additionalProperties"] == {}:
            del out["additionalProperties"]

    def _array(self, out: dict[str, Any], a: dict, b: dict, path: str) -> None:
        xa, xb = a.get("prefixItems", []), b.get("prefixItems", [])
        if not xa and not xb:
            return
        rest_a, rest_b = a.get("items", {}), b.get("items", {})
        out["prefixItems"] = [
            self.merge(xa[i] if i < len(xa) else rest_a, xb[i] if i < len(xb) else rest_b, path)
            for i in range(max(len(xa), len(xb)))
        ]


def _value_for(schema: dict[str, Any], name: str) -> NF:
    """What an object schema asks of the value of property `name`."""
    if name in schema.get("properties", {}):
        return schema["properties"][name]
    for pattern, sub in schema.get("patternProperties", {}).items():
        if re.search(pattern, name):
            return sub
    return schema.get("additionalProperties", {})


def _integer_bounds(node: dict[str, Any]) -> None:
    """Integer bounds as inclusive whole numbers (xgrammar wants whole numbers)."""
    low = [math.ceil(node.pop("minimum"))] if "minimum" in node else []
    if "exclusiveMinimum" in node:
        low.append(math.floor(node.pop("exclusiveMinimum")) + 1)
    high = [math.floor(node.pop("maximum"))] if "maximum" in node else []
    if "exclusiveMaximum" in node:
        high.append(math.ceil(node.pop("exclusiveMaximum")) - 1)
    if low:
        node["minimum"] = max(low)
    if high:
        node["maximum"] = min(high)
