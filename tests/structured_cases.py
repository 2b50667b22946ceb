"""Constraints the structured-output tests and benchmarks/grammar_overhead.py share.

Every schema bounds its output (maxLength, maxItems, enums, ranges), so a generation at
any temperature closes its JSON well within the tests' max_tokens.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 8}
I = {"type": "integer", "minimum": 0, "maximum": 99}  # noqa: E741

SCHEMAS: list[dict] = [
    # flat objects, required vs optional
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"a": I, "b": I}, "required": ["a"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "null"}, "y": I}, "required": ["x", "y"]},
    {
        "type": "object",
        "properties": {"title": S, "tags": {"type": "array", "items": S, "maxItems": 2}},
        "required": ["title"],
    },
    # nested objects
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": I, "name": S},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": I}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    # arrays with min/max items
    {"type": "array", "items": I, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 1},
    {
        "type": "object",
        "properties": {
            "pts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {"type": "array", "items": I, "minItems": 2, "maxItems": 2},
            }
        },
        "required": ["pts"],
    },
    {"type": "array", "prefixItems": [S, I], "items": False, "minItems": 2},
    # enums and const
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {"size": {"enum": ["S", "M", "L"]}, "qty": {"enum": [1, 2, 3]}},
        "required": ["size", "qty"],
    },
    {"type": "object", "properties": {"v": {"const": "1.0"}, "n": I}, "required": ["v", "n"]},
    {"const": {"fixed": [1, 2]}},
    # numbers with ranges
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
    {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
    },
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
    # strings: lengths, patterns, formats
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    },
    {"type": "string", "format": "date"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "uuid"},
    {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}, "n": I},
        "required": ["day"],
    },
    # $ref / $defs
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": I, "y": I}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
    },
    {
        "$defs": {"color": {"enum": ["r", "g"]}},
        "type": "array",
        "items": {"$ref": "#/$defs/color"},
        "minItems": 1,
        "maxItems": 3,
    },
    # anyOf, type unions
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]},
    {"type": "object", "properties": {"id": {"anyOf": [I, S]}}, "required": ["id"]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {
        "type": "object",
        "properties": {"kind": {"const": "circle"}, "r": I},
        "required": ["kind", "r"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "anyOf": [
                        {"type": "object", "properties": {"n": I}, "required": ["n"]},
                        {"type": "boolean"},
                    ]
                },
            }
        },
        "required": ["items"],
    },
]

REGEXES = [
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",  # date
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",  # email
    r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    r"\+1 \([0-9]{3}\) [0-9]{3}-[0-9]{4}",  # phone
    r"(cat|dog|bird)s?",  # alternation
]

CHOICES = [["yes", "no"], ["Paris", "London", "Berlin", "Madrid"], ["a b", 'a"b', "ä"]]

ARITHMETIC = r"""
root ::= expr
expr ::= term ([+-] term){0,3}
term ::= factor ([*/] factor){0,2}
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""

SQL = r"""
root ::= "SELECT " cols " FROM " table where? ";"
cols ::= "*" | col (", " col){0,2}
col ::= "id" | "name" | "age" | "city"
table ::= "users" | "orders"
where ::= " WHERE " col " " op " " value
op ::= "=" | "<" | ">"
value ::= [0-9]{1,3} | "'" [a-z]{1,6} "'"
"""
