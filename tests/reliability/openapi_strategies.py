"""Hypothesis strategies from the daemon's own OpenAPI document (schemathesis-like).

`schemathesis` pulls a large tree and runs against a live URL, and hypothesis-jsonschema
does not work with the hypothesis release pinned here; this covers the subset of OpenAPI
3.0 the document uses: $ref, type, enum, oneOf, properties/required/additionalProperties,
items, minimum/maximum, minItems/maxItems, nullable. `conforming` follows the schema;
`mutated` breaks it in one place (a wrong type, an unknown field, a bound crossed).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
ANY_JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=6,
)


class SchemaStrategies:
    """Strategies for the schemas of one OpenAPI document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            node: Any = self.doc
            for part in schema["$ref"].lstrip("#/").split("/"):
                node = node[part]
            schema = node
        return schema

    def conforming(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
        s = self.resolve(schema)
        if "enum" in s:
            return st.sampled_from(s["enum"])
        if "oneOf" in s and "properties" in s:
            # An object whose alternatives only add required fields (TokenizeRequest).
            rest = {k: v for k, v in s.items() if k != "oneOf"}
            return st.one_of(
                [
                    self._object(
                        {**rest, "required": [*rest.get("required", ()), *o["required"]]},
                        depth,
                    )
                    for o in s["oneOf"]
                ]
            )
        if "oneOf" in s:
            return st.one_of([self.conforming(o, depth + 1) for o in s["oneOf"]])
        kind = s.get("type")
        if isinstance(kind, list):
            return st.one_of([self.conforming({**s, "type": k}, depth) for k in kind])
        if kind is None:
            return ANY_JSON
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            lo, hi = s.get("minimum", -(2**31)), s.get("maximum", 2**31)
            return st.integers(min_value=lo, max_value=hi)
        if kind == "number":
            lo, hi = s.get("minimum", -1e6), s.get("maximum", 1e6)
            if "exclusiveMinimum" in s:
                lo = s["exclusiveMinimum"] + 1e-6
            return st.floats(min_value=lo, max_value=hi, allow_nan=False)
        if kind == "string":
            return st.text(max_size=16)
        if kind == "array":
            items = self.conforming(s.get("items", {}), depth + 1)
            return st.lists(
                items, min_size=s.get("minItems", 0), max_size=min(s.get("maxItems", 4), 4)
            )
        if kind == "object":
            return self._object(s, depth)
        return ANY_JSON

    def _object(self, s: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
        """Required fields plus a few optional ones (drawing each of ~35 optional fields
        separately made generation, not the server, the cost of the fuzz test)."""
        props = {k: self.conforming(v, depth + 1) for k, v in s.get("properties", {}).items()}
        required = [k for k in s.get("required", ()) if k in props]
        optional = sorted(k for k in props if k not in required)

        @st.composite
        def build(draw: st.DrawFn) -> dict[str, Any]:
            body = {k: draw(props[k]) for k in required}
            if optional:
                for k in draw(st.lists(st.sampled_from(optional), max_size=6, unique=True)):
                    body[k] = draw(props[k])
            return body

        return build()

    def mutated(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        """A conforming object with one field replaced by any JSON, or an unknown field."""
        s = self.resolve(schema)
        names = sorted(s.get("properties", {}))
        base = self.conforming(s)  # built once: building strategies per draw is slow

        @st.composite
        def build(draw: st.DrawFn) -> Any:
            body = draw(base)
            if not isinstance(body, dict) or not names:
                return draw(ANY_JSON)
            how = draw(st.sampled_from(["replace", "unknown", "drop"]))
            if how == "replace":
                body[draw(st.sampled_from(names))] = draw(ANY_JSON)
            elif how == "unknown":
                body[draw(st.text(min_size=1, max_size=10))] = draw(ANY_JSON)
            elif body:
                body.pop(draw(st.sampled_from(sorted(body))))
            return body

        return build()
