"""Cases for refs and combinators: $ref bases, allOf, anyOf, oneOf, not, if/then/else."""

from __future__ import annotations

from typing import Any

I = {"type": "integer"}  # noqa: E741
S = {"type": "string"}
OBJ_A = {"type": "object", "properties": {"a": I}, "required": ["a"]}

COMBINATOR_CASES: list[dict[str, Any]] = [
    # refs
    dict(name="ref-defs", schema={"$defs": {"n": I}, "type": "array",
         "items": {"$ref": "#/$defs/n"}},
         valid=[[1]], invalid=[["a"]]),
    dict(name="ref-definitions", schema={"definitions": {"s": S}, "properties": {"p": {
         "$ref": "#/definitions/s"}}, "required": ["p"]}, valid=[{"p": "x"}], invalid=[{"p": 1}]),
    dict(name="ref-urn-id", schema={"$id": "urn:example:root", "$defs": {"x": {
         "$id": "urn:example:x", "type": "integer"}},
         "properties": {"p": {"$ref": "urn:example:x"}},
         "required": ["p"]}, valid=[{"p": 1}], invalid=[{"p": "s"}]),
    dict(name="ref-relative-base", schema={"$id": "http://example.com/root.json",
         "properties": {"p": {"$id": "nested/", "$defs": {"t": S}, "properties": {"q": {
             "$ref": "#/$defs/t"}}, "required": ["q"]}}, "required": ["p"],
         "$defs": {"t": I}}, valid=[{"p": {"q": "s"}}], invalid=[{"p": {"q": 1}}]),
    dict(name="ref-anchor", schema={"$defs": {"x": {"$anchor": "thing", "type": "boolean"}},
         "properties": {"p": {"$ref": "#thing"}}, "required": ["p"]},
         valid=[{"p": True}], invalid=[{"p": 1}]),
    dict(name="ref-sibling", schema={"$defs": {"n": I}, "$ref": "#/$defs/n", "minimum": 5},
         valid=[5], invalid=[4]),
    dict(name="ref-recursive", schema={"$defs": {"node": {"type": "object", "properties": {
         "v": I, "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}}, "$ref": "#/$defs/node"},
         valid=[{"v": 1, "next": {"v": 2}}], invalid=[{"v": 1, "next": {"v": "x"}}, {"next": {}}]),
    dict(name="ref-root", schema={"type": "object", "properties": {"v": I, "c": {"$ref": "#"}}},
         valid=[{"v": 1, "c": {"v": 2}}], invalid=[{"c": {"v": "x"}}]),
    dict(name="ref-remote", schema={"$ref": "https://json-schema.org/draft/2020-12/schema"},
         refused="$ref"),
    dict(name="ref-missing", schema={"$ref": "#/$defs/nope"}, refused="$ref"),
    # allOf
    dict(name="allOf-merge", schema={"allOf": [OBJ_A, {"properties": {"b": S},
         "required": ["b"]}]}, valid=[{"a": 1, "b": "x"}], invalid=[{"a": 1}, {"b": "x"}]),
    dict(name="allOf-ranges", schema={"allOf": [{"type": "integer", "minimum": 0},
         {"maximum": 5}]}, valid=[0, 5], invalid=[-1, 9]),
    dict(name="allOf-conflict", schema={"allOf": [I, S]}, refused="unsatisfiable"),
    dict(name="allOf-two-patterns", schema={"allOf": [{"type": "string", "pattern": "a"},
         {"pattern": "b"}]}, refused="pattern"),
    dict(name="allOf-additional-false", schema={"allOf": [{"properties": {"a": I}}],
         "additionalProperties": False, "type": "object"}, valid=[{}], invalid=[{"a": 1}]),
    # anyOf
    dict(name="anyOf-sibling-type", schema={"type": "string", "anyOf": [{"maxLength": 2},
         {"minLength": 4}]}, valid=["ab", "abcd"], invalid=["abc", {"x": 1}]),
    dict(name="anyOf-objects", schema={"anyOf": [OBJ_A, I]}, valid=[{"a": 1}, 3],
         invalid=[{}, "s"]),
    # oneOf
    dict(name="oneOf-types", schema={"oneOf": [I, S]}, valid=[1, "s"], invalid=[None]),
    dict(name="oneOf-discriminator", schema={"oneOf": [
         {"type": "object", "properties": {"kind": {"const": "a"}, "x": I},
          "required": ["kind", "x"]},
         {"type": "object", "properties": {"kind": {"const": "b"}, "y": S},
          "required": ["kind", "y"]}]},
         valid=[{"kind": "a", "x": 1}, {"kind": "b", "y": "s"}],
         invalid=[{"kind": "a", "y": "s"}, {"kind": "c", "x": 1}]),
    dict(name="oneOf-overlap", schema={"oneOf": [{"type": "integer", "minimum": 0},
         {"maximum": 5}]}, refused="oneOf"),
    # not
    dict(name="not-type", schema={"not": {"type": "string"}}, valid=[1, None], invalid=["s"]),
    dict(name="not-const-int", schema={"type": "integer", "minimum": 0, "maximum": 5,
         "not": {"const": 3}}, valid=[2, 4], invalid=[3]),
    dict(name="not-enum-string", schema={"type": "string", "not": {"enum": ["a", "ab"]}},
         valid=["b", "abc", ""], invalid=["a", "ab"]),
    dict(name="not-enum-trie", schema={"type": "string", "not": {"enum": ["root", "admin", "ad"]}},
         valid=["adm", "a", "", "roots", "x", "rot"], invalid=["root", "admin", "ad"]),
    dict(name="not-enum-bool", schema={"type": "boolean", "not": {"const": True}},
         valid=[False], invalid=[True]),
    dict(name="not-complex", schema={"not": {"minimum": 3}}, refused="not"),
    # if / then / else
    dict(name="if-const", schema={"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
         "x": I}, "required": ["kind"], "if": {"properties": {"kind": {"const": "a"}}},
         "then": {"required": ["x"]}, "else": {"properties": {"x": {"maximum": 0}}}},
         valid=[{"kind": "a", "x": 5}, {"kind": "b"}, {"kind": "b", "x": 0}],
         invalid=[{"kind": "a"}, {"kind": "b", "x": 5}]),
    dict(name="if-other", schema={"type": "integer", "if": {"minimum": 3},
         "then": {"maximum": 5}}, refused="if"),
]  # fmt: skip
