"""Resolve every `$ref` of a schema into one self-contained tree.

Refs resolve as a validator resolves them (the `referencing` library, jsonschema's own):
against the base URI in force where they appear (`$id`, URNs), through `$anchor`s, JSON
pointers and `$defs`/`definitions`. The result has no `$id`, `$anchor` or `$defs` of the
input: a ref to a schema that does not contain itself is inlined; a ref that recurses becomes
`{"$ref": "#/$defs/<name>"}` into the one `$defs` of the root. A ref nothing in the schema
defines (a remote URL such as a metaschema) is refused: nothing is fetched.

```
{"$id": "urn:a", "$defs": {"n": {"$anchor": "x", ...}}, "properties": {"p": {"$ref": "#x"}}}
  -> {"properties": {"p": {...the body of n...}}}
```
"""

from __future__ import annotations

from typing import Any

import referencing.exceptions
from referencing import Registry, Specification
from referencing._core import Resolver
from referencing.jsonschema import DRAFT201909, DRAFT202012, specification_with

from grammars.schema.errors import SchemaRefusal

# Keywords whose value is one subschema / a map of subschemas / a list of subschemas
# (all drafts). `items` and `dependencies` may be either kind.
SUB_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties",
           "unevaluatedItems", "propertyNames", "if", "then", "else", "not", "contains",
           "contentSchema")  # fmt: skip
SUB_MAP = ("properties", "patternProperties", "dependentSchemas", "dependencies")
SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# Identity and definition keywords: meaningless once every ref is resolved.
_DROPPED = ("$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$schema",
            "$vocabulary", "$defs", "definitions", "$comment")  # fmt: skip
# Expanding refs copies their targets; a schema built to explode is refused past this.
MAX_NODES = 20_000


def resolve_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every ref resolved (see the module docstring); SchemaRefusal if not."""
    dialect = schema.get("$schema")
    if dialect:
        spec = specification_with(dialect, default=DRAFT202012)
    else:
        # Undeclared: 2020-12, unless the schema spells items as an array (2019-09 and older).
        spec = DRAFT201909 if has_items_array(schema) else DRAFT202012
    resource = spec.create_resource(schema)
    uri = resource.id() or ""
    registry = Registry().with_resource(uri, resource).crawl()
    bundler = _Bundler(spec)
    root = bundler.expand_target(schema, registry.resolver(base_uri=uri), "#")
    if bundler.defs:
        root = {"allOf": [root]} if "$ref" in root else dict(root)
        root["$defs"] = bundler.defs
    return root


class _Bundler:
    """One expansion: the recursive targets found so far and the ones being expanded."""

    def __init__(self, specification: Specification[Any]) -> None:
        self.spec = specification
        self.defs: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._stack: list[int] = []
        self._recursive: set[int] = set()
        self._nodes = 0

    def expand_target(self, target: Any, resolver: Resolver[Any], path: str) -> Any:
        key = id(target)
        if key in self._stack or key in self._recursive:
            self._recursive.add(key)
            return {"$ref": f"#/$defs/{self._name(key)}"}
        self._stack.append(key)
        try:
            out = self._expand(target, resolver, path)
        finally:
            self._stack.pop()
        if key in self._recursive:
            self.defs[self._name(key)] = out
            return {"$ref": f"#/$defs/{self._name(key)}"}
        return out

    def _name(self, key: int) -> str:
        return self._names.setdefault(key, f"ref{len(self._names)}")

    def _expand(self, node: Any, resolver: Resolver[Any], path: str) -> Any:
        if not isinstance(node, dict):
            return node
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise SchemaRefusal("$ref", path, f"more than {MAX_NODES} subschemas once refs expand")
        if self.spec.id_of(node) is not None:
            resolver = resolver.in_subresource(self.spec.create_resource(node))
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROPPED or key == "$ref":
                continue
            where = f"{path}/{key}"
            if key in SUB_ONE and isinstance(value, (dict, bool)):
                out[key] = self._expand(value, resolver, where)
            elif key in SUB_MAP and isinstance(value, dict):
                out[key] = {
                    k: self._expand(v, resolver, f"{where}/{_escape(k)}") for k, v in value.items()
                }
            elif key in SUB_LIST and isinstance(value, list):
                out[key] = [self._expand(v, resolver, f"{where}/{i}") for i, v in enumerate(value)]
            else:
                out[key] = value
        ref = node.get("$ref")
        if ref is None:
            return out
        if not isinstance(ref, str):
            raise SchemaRefusal("$ref", path, "expected a string")
        try:
            resolved = resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            raise SchemaRefusal(
                "$ref", path, f"{ref!r} is not defined in the schema (remote refs are not fetched)"
            ) from None
        target = self.expand_target(resolved.contents, resolved.resolver, f"{path}/$ref")
        # Keywords next to a ref apply too (2019-09 on; earlier drafts ignore them: obeying
        # them as well only narrows the output).
        return {"allOf": [target, out]} if out else target


def has_items_array(node: Any) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("items"), list) or any(has_items_array(v) for v in node.values())
    return isinstance(node, list) and any(has_items_array(v) for v in node)


def _escape(name: str) -> str:
    """A name as a JSON-pointer token."""
    return name.replace("~", "~0").replace("/", "~1")
