"""The last check: every keyword left is one xgrammar 0.2.9 enforces exactly.

Probed keyword by keyword (tests/test_schema_corpus.py pins each class: the valid instance
is accepted, the invalid one refused token by token). The normaliser already refuses what it
cannot rewrite; this walk guarantees nothing else reaches the compiler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grammars.schema.merge import NF

if TYPE_CHECKING:
    from grammars.schema.normalize import Policy

ENFORCED: dict[str, frozenset[str]] = {
    "string": frozenset({"type", "minLength", "maxLength", "pattern"}),
    "integer": frozenset({"type", "minimum", "maximum", "multipleOf"}),
    "number": frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "boolean": frozenset({"type"}),
    "null": frozenset({"type"}),
    "array": frozenset({"type", "items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"type", "properties", "required", "additionalProperties",
                         "patternProperties", "propertyNames", "minProperties",
                         "maxProperties"}),
}  # fmt: skip
# Where a `false` subschema compiles (anywhere else xgrammar rejects it).
_FALSE_OK = ("items", "additionalProperties")


def check(nf: NF, policy: Policy, path: str) -> NF:
    """`nf` with every keyword xgrammar would not enforce refused (or dropped)."""
    if nf is False:
        policy.refuse("", path, "no value satisfies this schema (its keywords contradict)")
        return {}
    if nf == {} or "$ref" in nf or "enum" in nf:
        return nf
    if "anyOf" in nf:
        return {"anyOf": [check(b, policy, f"{path}/anyOf/{i}") for i, b in enumerate(nf["anyOf"])]}
    node = dict(nf)
    kind = node["type"]
    for key in list(node):
        if key not in ENFORCED[kind]:
            policy.refuse(key, path, f"{key!r} is not enforced on a {kind}")
            node.pop(key)
    if kind == "string" and "pattern" in node and ({"minLength", "maxLength"} & set(node)):
        policy.refuse("maxLength", path, "lengths together with a pattern are not enforced")
        node.pop("minLength", None)
        node.pop("maxLength", None)
    step = node.get("multipleOf") if kind == "integer" else None
    if step is not None and (not isinstance(step, int) or {"minimum", "maximum"} & set(node)):
        policy.refuse("multipleOf", path, "multipleOf is enforced on whole numbers, no range")
        node.pop("multipleOf")
    if (
        kind == "object"
        and "propertyNames" in node
        and ("properties" in node or "patternProperties" in node)
    ):
        policy.refuse("propertyNames", path, "propertyNames next to properties is not enforced")
        node.pop("propertyNames")
    for key in ("items", "additionalProperties", "propertyNames"):
        if key in node and not (node[key] is False and key in _FALSE_OK):
            node[key] = check(node[key], policy, f"{path}/{key}")
    if "prefixItems" in node:
        node["prefixItems"] = [
            check(s, policy, f"{path}/prefixItems/{i}") for i, s in enumerate(node["prefixItems"])
        ]
    for key in ("properties", "patternProperties"):
        if key in node:
            node[key] = {k: check(s, policy, f"{path}/{key}/{_token(k)}")
                         for k, s in node[key].items()}  # fmt: skip
    if len(node.get("patternProperties", {})) > 1:
        policy.refuse("patternProperties", path, "more than one pattern is not enforced")
        node.pop("patternProperties")
    return node


def _token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
