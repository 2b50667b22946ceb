"""The validator that judges outputs: jsonschema, in the draft the schema is written in."""

from __future__ import annotations

from typing import Any

import jsonschema

from grammars.schema.refs import has_items_array


def validator_for(schema: Any) -> jsonschema.protocols.Validator:
    """A validator (formats checked where jsonschema can) for the schema's own draft.

    `$schema` decides; without it 2020-12, or 2019-09 when `items` is an array (the
    older spelling, which a 2020-12 validator cannot read).
    """
    default = jsonschema.Draft201909Validator if has_items_array(schema) else None
    cls = jsonschema.validators.validator_for(
        schema, default=default or jsonschema.Draft202012Validator
    )
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def output_errors(schema: Any, instance: Any) -> list[str]:
    """Why `instance` breaks `schema` (JSON pointer: message), empty when it validates."""
    return [
        f"#/{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator_for(schema).iter_errors(instance)
    ]
