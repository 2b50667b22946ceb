"""One schema object's parts: its draft's spellings, its types, and one node per type."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from grammars.schema.formats import FORMAT_PATTERNS, NUMBER_FORMATS
from grammars.schema.merge import NF

if TYPE_CHECKING:
    from grammars.schema.normalize import Normalizer

TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
# The keywords that describe each type, as the normal form keeps them.
KEYWORDS: dict[str, tuple[str, ...]] = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
               "format"),
    "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems",
              "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
               "dependentRequired", "dependentSchemas"),
}  # fmt: skip
_IMPLIED = {k: t for t, ks in KEYWORDS.items() if t != "integer" for k in ks if k != "format"}
_IMPLIED["format"] = "string"


def upgrade(node: dict[str, Any]) -> dict[str, Any]:
    """Older drafts' spellings in 2020-12 terms (items arrays, boolean exclusive bounds)."""
    node = dict(node)
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    node.pop("additionalItems", None)  # without an items array it means nothing
    for bound, flag in (("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")):
        if isinstance(node.get(flag), bool) and node.pop(flag) and bound in node:
            node[flag] = node.pop(bound)
    if "const" in node and "enum" in node:
        node["enum"] = [v for v in node["enum"] if v == node["const"]]
        node.pop("const")
    return node


def dependencies(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, required names or a schema) for each dependency the node declares."""
    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        if isinstance(node.get(key), dict):
            yield from node[key].items()


def types_of(node: dict[str, Any]) -> list[str] | None:
    """The types the node allows: declared, else implied by its keywords; None: any."""
    declared = node.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        types = [t for t in TYPES if t in declared]
        unknown = [t for t in declared if t not in TYPES]
        if unknown:
            raise ValueError(f"unknown type {unknown[0]!r}")
    else:
        implied = {_IMPLIED[k] for k in node if k in _IMPLIED}
        if "format" in node and node["format"] in NUMBER_FORMATS:
            implied.discard("string")
            implied.add("number")
        if not implied:
            return None
        types = [t for t in TYPES if t in implied]
    if "number" in types and "integer" in types:
        types.remove("integer")
    return types


def typed(kind: str, node: dict[str, Any], norm: Normalizer, path: str) -> NF:
    """The node of one type: its keywords, subschemas normalised."""
    out: dict[str, Any] = {"type": kind}
    for key in KEYWORDS.get(kind, ()):
        if key not in node:
            continue
        value = node[key]
        where = f"{path}/{key}"
        if key in ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                   "propertyNames"):  # fmt: skip
            out[key] = norm.normalize(value, where)
        elif key in ("properties", "patternProperties"):
            out[key] = {k: norm.normalize(v, f"{where}/{k}") for k, v in value.items()}
        elif key == "prefixItems":
            out[key] = [norm.normalize(v, f"{where}/{i}") for i, v in enumerate(value)]
        elif key in ("dependentRequired", "dependentSchemas"):
            continue  # merged by the normaliser
        elif key == "format":
            _format(out, value, norm, path)
        else:
            out[key] = value
    for key in ("unevaluatedItems", "unevaluatedProperties"):
        # Once every subschema merged into this node, unevaluated means additional.
        if key in out:
            alias = "items" if key == "unevaluatedItems" else "additionalProperties"
            value = out.pop(key)
            out.setdefault(alias, value)
    if kind == "integer" or kind == "number":
        return _numeric(out, norm, path)
    return out


def _format(out: dict[str, Any], fmt: Any, norm: Normalizer, path: str) -> None:
    kind = out["type"]
    if kind in ("integer", "number"):
        if fmt in NUMBER_FORMATS:
            low, high = NUMBER_FORMATS[fmt]
            if low is not None:
                out["minimum"], out["maximum"] = low, high
            return
        norm.policy.refuse("format", path, f"format {fmt!r} is not enforced on numbers")
        return
    if fmt not in FORMAT_PATTERNS:
        norm.policy.refuse("format", path, f"format {fmt!r} is not enforced")
        return
    out["format"] = fmt  # finish() turns it into a pattern once lengths are known


def _numeric(out: dict[str, Any], norm: Normalizer, path: str) -> NF:
    step = out.get("multipleOf")
    if step is not None and not (isinstance(step, int) and step > 0):
        if isinstance(step, float) and step.is_integer() and step > 0:
            out["multipleOf"] = int(step)
        else:
            norm.policy.refuse("multipleOf", path, "multipleOf is enforced only for integers")
            out.pop("multipleOf")
    if "multipleOf" in out and out["type"] == "number":
        out["type"] = "integer"
    if out["type"] == "integer":
        return norm.merge(out, {"type": "integer"}, path)  # whole-number bounds
    return out


def disjoint(x: NF, y: NF, norm: Normalizer) -> bool:
    """No value matches both: told apart by type, by values, or by a required property."""
    if x is False or y is False:
        return True
    if x == {} or y == {} or "$ref" in x or "$ref" in y:
        return False
    for a, b in ((x, y), (y, x)):
        if "anyOf" in a:
            return all(disjoint(branch, b, norm) for branch in a["anyOf"])
    for a, b in ((x, y), (y, x)):
        if "enum" in a:
            return not any(norm.valid(v, b) for v in a["enum"])
    kinds = {x["type"], y["type"]}
    if len(kinds) > 1 and kinds != {"integer", "number"}:
        return True
    if x["type"] != "object":
        return False
    for name in set(x.get("required", [])) & set(y.get("required", [])):
        px, py = x.get("properties", {}).get(name), y.get("properties", {}).get(name)
        if px is not None and py is not None and disjoint(px, py, norm):
            return True
    return False


def property_test(schema: Any) -> tuple[str, list[Any], bool] | None:
    """(name, allowed values, required) when `schema` only tests one property's value."""
    if not isinstance(schema, dict):
        return None
    rest = {k: v for k, v in schema.items() if k not in ("properties", "required", "type")}
    props = schema.get("properties")
    if rest or not isinstance(props, dict) or len(props) != 1:
        return None
    if schema.get("type", "object") != "object":
        return None
    ((name, test),) = props.items()
    if not isinstance(test, dict) or set(test) - {"const", "enum", "type"}:
        return None
    values = [test["const"]] if "const" in test else test.get("enum")
    if not isinstance(values, list):
        return None
    required = schema.get("required", [])
    if set(required) - {name}:
        return None
    return name, values, name in required
