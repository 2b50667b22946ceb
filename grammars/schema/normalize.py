"""Any JSON Schema (refs resolved) -> normal form (NF, see merge.py) with the same meaning.

Per schema object: the keywords about one type go to a node of that type (a type list, or
keywords of several types with no `type`, become an anyOf of one node per type: an untyped
schema gets the types its keywords imply); `const`/`enum` keep only the values the rest of
the object allows; then `allOf` branches, `anyOf`, `oneOf` (only where its branches are
provably disjoint), `not`, `if`/`then`/`else` and dependencies merge into it.
What cannot be expressed exactly raises SchemaRefusal (keyword + pointer); with a
`Policy(strict=False)` the keyword is dropped instead and listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jsonschema

from grammars.schema import shapes
from grammars.schema.errors import SchemaRefusal
from grammars.schema.merge import NF, Merger, any_of
from grammars.schema.negate import complement

# Assertions no normal form expresses (refused when strict).
UNENFORCED = {
    "minContains": "array 'minContains'/'maxContains' is not enforced",
    "maxContains": "array 'minContains'/'maxContains' is not enforced",
    "contentEncoding": "content keywords are not enforced",
    "contentMediaType": "content keywords are not enforced",
    "contentSchema": "content keywords are not enforced",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "recursive references are not supported",
}


@dataclass(slots=True)
class Policy:
    """strict: refuse what is not enforced; else drop it and list where (`dropped`)."""

    strict: bool
    dropped: list[str] = field(default_factory=list)

    def refuse(self, keyword: str, path: str, why: str) -> None:
        error = SchemaRefusal(keyword, path, why)
        if self.strict:
            raise error
        if error.where not in self.dropped:
            self.dropped.append(error.where)


class Normalizer:
    """One schema's normalisation: its recursive definitions and the refusal policy."""

    def __init__(self, defs: dict[str, Any], policy: Policy) -> None:
        self.policy = policy
        # None: not normalised yet (merging it is refused, validating against it fails).
        self.defs: dict[str, NF] = dict.fromkeys(defs)
        self.merger = Merger(self.defs, self.valid)
        for name, body in defs.items():
            self.defs[name] = self.normalize(body, f"#/$defs/{name}")

    def valid(self, value: Any, schema: NF) -> bool:
        """Whether `value` validates against NF `schema` (refs into the definitions)."""
        defs = {k: False if v is None else v for k, v in self.defs.items()}
        root = {**schema, "$defs": defs} if isinstance(schema, dict) else schema
        return jsonschema.Draft202012Validator(root).is_valid(value)

    def merge(self, a: NF, b: NF, path: str) -> NF:
        try:
            return self.merger.merge(a, b, path)
        except SchemaRefusal as e:
            self.policy.refuse(e.keyword, e.pointer, e.why)
            return a

    def normalize(self, node: Any, path: str) -> NF:
        if node is True or node == {}:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise SchemaRefusal("type", path, "a schema must be an object or a boolean")
        node = shapes.upgrade(node)
        for key in UNENFORCED:
            if key in node:
                self.policy.refuse(key, path, UNENFORCED[key])
        if "$ref" in node:
            return {"$ref": node["$ref"]}
        acc = self.simple(node, path)
        for i, branch in enumerate(node.get("allOf", [])):
            acc = self.merge(acc, self.normalize(branch, f"{path}/allOf/{i}"), path)
        if "anyOf" in node:
            branches = [self.normalize(b, f"{path}/anyOf/{i}") for i, b in enumerate(node["anyOf"])]
            acc = self.merge(acc, any_of(branches), path)
        if "oneOf" in node:
            acc = self.one_of(acc, node["oneOf"], path)
        if "not" in node:
            acc = self.negate(acc, node["not"], path)
        if "if" in node:
            acc = self.conditional(acc, node, path)
        if "contains" in node:
            acc = self.contains(acc, node["contains"], path)
        for name, extra in shapes.dependencies(node):
            acc = self.merge(acc, self.dependency(name, extra, path), path)
        return acc

    def simple(self, node: dict[str, Any], path: str) -> NF:
        """The object without its combinators, in NF."""
        try:
            types = shapes.types_of(node)
        except ValueError as e:
            raise SchemaRefusal("type", path, str(e)) from None
        if types is None:
            return self.values(node, {}, path)
        branches = [shapes.typed(t, node, self, path) for t in types]
        return self.values(node, any_of(branches), path)

    def values(self, node: dict[str, Any], rest: NF, path: str) -> NF:
        """`rest` narrowed to the node's const/enum, if it has one."""
        if "const" in node:
            allowed = [node["const"]]
        elif isinstance(node.get("enum"), list):
            allowed = node["enum"]
        else:
            return rest
        kept = [v for v in allowed if rest == {} or (rest is not False and self.valid(v, rest))]
        return {"enum": kept} if kept else False

    def one_of(self, acc: NF, branches: list[Any], path: str) -> NF:
        """oneOf as anyOf, when no value can match two branches (else refused)."""
        nfs = [
            self.merge(acc, self.normalize(b, f"{path}/oneOf/{i}"), path)
            for i, b in enumerate(branches)
        ]
        live = [b for b in nfs if b is not False]
        for i, x in enumerate(live):
            for y in live[i + 1 :]:
                if not shapes.disjoint(x, y, self):
                    self.policy.refuse("oneOf", path, "branches that may overlap (use anyOf)")
                    return any_of(live)
        return any_of(live)

    def negate(self, acc: NF, sub: Any, path: str) -> NF:
        """acc without the values `sub` allows: `not` of a type, a const or an enum."""
        excluded = complement(sub)
        if excluded is None:
            self.policy.refuse("not", path, "only not: {type}, {const} or {enum} is enforced")
            return acc
        return self.merge(acc, excluded, path)

    def conditional(self, acc: NF, node: dict[str, Any], path: str) -> NF:
        """if/then/else where `if` tests one property against a const or an enum."""
        test = shapes.property_test(node["if"])
        if test is None:
            self.policy.refuse("if", path, "only if: {properties: {p: {const|enum}}} is enforced")
            return acc
        name, values, required = test
        then = self.normalize(node.get("then", {}), f"{path}/then")
        other = self.normalize(node.get("else", {}), f"{path}/else")
        prop = {"type": "object", "required": [name]}
        matches = self.normalize({**prop, "properties": {name: {"enum": values}}}, path)
        misses = self.normalize({**prop, "properties": {name: {"not": {"enum": values}}}}, path)
        absent = self.normalize({"type": "object", "properties": {name: False}}, path)
        non_object = self.normalize({"not": {"type": "object"}}, path)
        branches = [
            self.merge(matches, then, path),
            self.merge(misses, other, path),
            self.merge(absent, other if required else then, path),
            self.merge(non_object, then, path),
        ]
        return self.merge(acc, any_of(branches), path)

    def contains(self, acc: NF, sub: Any, path: str) -> NF:
        """`contains` enforced by narrowing: one of the first few items is the match.

        The output may hold a match anywhere; the grammar asks for it at the first position
        where the array's own items allow one (0..3), which satisfies the keyword.
        """
        match = self.normalize(sub, f"{path}/contains")
        for k in range(4):
            at_k = {"type": "array", "prefixItems": [{}] * k + [match], "minItems": k + 1}
            merged = self.merge(acc, at_k, path)
            branches = merged.get("anyOf", [merged]) if isinstance(merged, dict) else []
            # A `false` item at or before k: no array of that branch can hold the match there.
            if any(False not in b.get("prefixItems", [])[: k + 1] for b in branches):
                return merged
        self.policy.refuse("contains", path, "no item of the first four can match contains")
        return acc

    def dependency(self, name: str, extra: Any, path: str) -> NF:
        """A dependentRequired / dependentSchemas entry: name absent, or present and `extra`."""
        absent = self.normalize({"type": "object", "properties": {name: False}}, path)
        if isinstance(extra, list):
            extra = {"required": extra}
        present = self.normalize({"allOf": [extra], "required": [name]}, f"{path}/{name}")
        return any_of([absent, present])
