"""A collection of realistic JSON Schemas for benchmarks/grammar_coverage.py.

Written for headrace in the shapes real schemas take (API payloads, OpenAPI components,
config files, tool parameters, GeoJSON, calendar and commerce records): `$ref`s through
`$defs`/`definitions`/`$id`, discriminated `oneOf`s, `allOf` composition, formats, enums,
`patternProperties`, conditionals. Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
N = {"type": "number"}
B = {"type": "boolean"}
EMAIL = {"type": "string", "format": "email"}
WHEN = {"type": "string", "format": "date-time"}
ID = {"type": "string", "format": "uuid"}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, **kw}
    if required is not None:
        out["required"] = required
    return out


ADDRESS = obj({"street": S, "city": S, "postalCode": {"type": "string", "pattern": "^[0-9]{5}$"},
               "country": {"type": "string", "enum": ["US", "DE", "FR", "JP", "GB"]}},
              ["street", "city", "country"], additionalProperties=False)  # fmt: skip

SCHEMAS: dict[str, dict[str, Any]] = {
    "user": obj({"id": ID, "name": {"type": "string", "minLength": 1, "maxLength": 40},
                 "email": EMAIL, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                 "roles": {"type": "array", "items": {"enum": ["admin", "dev", "viewer"]},
                           "uniqueItems": True}}, ["id", "name", "email"]),
    "address": ADDRESS,
    "order": {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$id": "https://shop.example.com/order.json",
              "type": "object",
              "properties": {"orderId": ID, "placed": WHEN,
                             "items": {"type": "array", "minItems": 1,
                                       "items": {"$ref": "#/$defs/line"}},
                             "ship": {"$ref": "#/$defs/address"},
                             "status": {"enum": ["new", "paid", "shipped", "cancelled"]}},
              "required": ["orderId", "items", "status"],
              "$defs": {"line": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                     "qty": {"type": "integer", "minimum": 1},
                                     "price": {"type": "number", "exclusiveMinimum": 0}},
                                    ["sku", "qty"]),
                        "address": ADDRESS}},
    "draft7-definitions": {"$schema": "http://json-schema.org/draft-07/schema#",
                           "definitions": {"tag": {"type": "string", "maxLength": 20}},
                           "type": "object",
                           "properties": {"title": S, "tags": {"type": "array",
                                          "items": {"$ref": "#/definitions/tag"}, "maxItems": 5}},
                           "required": ["title"]},
    "event": obj({"summary": S, "start": WHEN, "end": WHEN,
                  "timezone": {"type": "string", "pattern": "^[A-Za-z]+/[A-Za-z_]+$"},
                  "recurrence": {"type": "string", "format": "duration"},
                  "attendees": {"type": "array", "items": EMAIL}}, ["summary", "start"]),
    "geojson-point": obj({"type": {"const": "Point"},
                          "coordinates": {"type": "array", "prefixItems": [
                              {"type": "number", "minimum": -180, "maximum": 180},
                              {"type": "number", "minimum": -90, "maximum": 90}],
                              "minItems": 2, "maxItems": 2}}, ["type", "coordinates"]),
    "shape-union": {"oneOf": [
        obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}, ["kind", "r"]),
        obj({"kind": {"const": "rect"}, "w": N, "h": N}, ["kind", "w", "h"]),
        obj({"kind": {"const": "tri"}, "a": N, "b": N, "c": N}, ["kind", "a", "b", "c"])]},
    "payment": {"type": "object", "required": ["method"],
                "properties": {"method": {"enum": ["card", "iban"]}, "card": S, "iban": S},
                "if": {"properties": {"method": {"const": "card"}}},
                "then": {"required": ["card"]}, "else": {"required": ["iban"]}},
    "pet-allof": {"$defs": {"base": obj({"id": I, "name": S}, ["id", "name"])},
                  "allOf": [{"$ref": "#/$defs/base"},
                            obj({"species": {"enum": ["cat", "dog"]}}, ["species"])]},
    "config-env": obj({"name": S, "env": {"type": "object",
                       "patternProperties": {"^[A-Z_][A-Z0-9_]*$": S},
                       "additionalProperties": False}}, ["name"]),
    "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63},
               "maxProperties": 8},
    "http-headers": {"type": "object", "propertyNames": {"pattern": "^[A-Za-z-]+$"},
                     "additionalProperties": S},
    "tree": {"$defs": {"node": obj({"value": I, "children": {"type": "array",
                       "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, ["value"])},
             "$ref": "#/$defs/node"},
    "linked-list": {"type": "object", "properties": {"v": S, "next": {"$ref": "#"}},
                    "required": ["v"]},
    "nullable-fields": obj({"nickname": {"type": ["string", "null"]},
                            "score": {"type": ["number", "null"], "minimum": 0}},
                           ["nickname", "score"]),
    "openapi-pet": {"type": "object", "required": ["name", "photoUrls"],
                    "properties": {"id": {"type": "integer", "format": "int64"},
                                   "name": {"type": "string", "example": "doggie"},
                                   "photoUrls": {"type": "array", "items": {"type": "string",
                                                 "format": "uri"}},
                                   "status": {"type": "string", "description": "store status",
                                              "enum": ["available", "pending", "sold"]}}},
    "openapi-error": obj({"code": {"type": "integer", "format": "int32"}, "message": S},
                         ["code", "message"]),
    "tool-weather": obj({"location": {"type": "string", "description": "City, country"},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                        ["location"], additionalProperties=False),
    "tool-search": obj({"query": {"type": "string", "minLength": 1},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
                        "filters": obj({"after": {"type": "string", "format": "date"},
                                        "site": {"type": "string", "format": "hostname"}})},
                       ["query"]),
    "server": obj({"host": {"anyOf": [{"type": "string", "format": "ipv4"},
                                      {"type": "string", "format": "ipv6"},
                                      {"type": "string", "format": "hostname"}]},
                   "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                   "tls": B}, ["host", "port"]),
    "color": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
    "semver": {"type": "string", "pattern": "^(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)"
               "(-[0-9A-Za-z.-]+)?$"},
    "money": obj({"amount": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]{2})?$"},
                  "currency": {"enum": ["USD", "EUR", "JPY"]}}, ["amount", "currency"]),
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2,
               "items": {"type": "array", "items": N, "minItems": 2, "maxItems": 2}},
    "survey": obj({"answers": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                           "maximum": 5}, "maxItems": 10},
                   "comment": {"type": "string", "maxLength": 200}}, ["answers"]),
    "feature-flags": {"type": "object", "additionalProperties": B, "minProperties": 1},
    "log-entry": obj({"ts": WHEN, "level": {"enum": ["debug", "info", "warn", "error"]},
                      "msg": S, "fields": {"type": "object", "additionalProperties": {
                          "type": ["string", "number", "boolean"]}}}, ["ts", "level", "msg"]),
    "file-upload": obj({"name": S, "content": {"type": "string", "format": "byte"},
                        "size": {"type": "integer", "minimum": 0}}, ["name", "content"]),
    "not-reserved": obj({"username": {"type": "string", "not": {"enum": ["root", "admin"]}}},
                        ["username"]),
    "dependent": {"type": "object", "properties": {"card": S, "billing": ADDRESS},
                  "dependentRequired": {"card": ["billing"]}},
    "draft4-legacy": {"$schema": "http://json-schema.org/draft-04/schema#",
                      "id": "http://example.com/legacy#", "type": "object",
                      "properties": {"count": {"type": "integer", "minimum": 0,
                                               "exclusiveMinimum": True},
                                     "pair": {"type": "array", "items": [S, I],
                                              "additionalItems": False}},
                      "required": ["count"]},
    "anchor-ref": {"$defs": {"p": {"$anchor": "percent", "type": "number", "minimum": 0,
                                   "maximum": 100}},
                   "type": "object", "properties": {"cpu": {"$ref": "#percent"},
                                                    "mem": {"$ref": "#percent"}}},
    "urn-ids": {"$id": "urn:example:inventory", "type": "object",
                "properties": {"item": {"$ref": "urn:example:item"}},
                "$defs": {"item": {"$id": "urn:example:item", "type": "object",
                                   "properties": {"sku": S, "count": I}, "required": ["sku"]}}},
    "contact-oneof": {"type": "object", "properties": {"contact": {"oneOf": [
        {"type": "string", "format": "email"},
        obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{7,15}$"}}, ["phone"])]}},
        "required": ["contact"]},
    "rgb-tuple": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0,
                  "maximum": 255}] * 3, "items": False, "minItems": 3},
    "enum-objects": {"enum": [{"plan": "free", "seats": 1}, {"plan": "team", "seats": 10}]},
    "time-slot": obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                      "from": {"type": "string", "format": "time"},
                      "to": {"type": "string", "format": "time"}}, ["day", "from", "to"]),
    "bounded-text": {"type": "string", "minLength": 3, "maxLength": 12},
    "unique-tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                    "maxItems": 5},
    "contains-admin": {"type": "array", "items": S, "contains": {"const": "admin"}},
    "email-bounded": {"type": "string", "format": "email", "maxLength": 254},
}  # fmt: skip
