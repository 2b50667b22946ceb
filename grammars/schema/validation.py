"""The validator that judges outputs: jsonschema, in the draft the schema is written in."""

from __future__ import annotations

from typing import Any

import jsonschema

from grammars.schema.refs import has_items_array


def _hostname_limits(text: object) -> bool:
    """RFC 1123 lengths (labels of 1-63, 253 in all), which the format patterns leave out."""
    if not isinstance(text, str):
        return True
    host = text.rpartition("@")[2] if "@" in text else text
    if "://" in host:
        host = host.split("://", 1)[1].split("/", 1)[0].split(":", 1)[0]
    labels = host.split(".")
    return len(host) <= 253 and all(0 < len(label) <= 63 for label in labels)


def format_checker(cls: type) -> jsonschema.FormatChecker:
    """The draft's format checker, plus the host-name lengths for hostname, email and uri."""
    # NOTE: not FormatChecker(names): that looks the names up in the class-wide table,
    # where the draft-3 `time` (HH:MM:SS, no offset) overrides the later drafts' RFC 3339
    # one, so every valid 2020-12 time failed the check.
    checker = jsonschema.FormatChecker(())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    for name in ("hostname", "email", "uri"):
        inner = checker.checkers.get(name)

        def check(text: object, inner=inner) -> bool:
            return _hostname_limits(text) and (inner is None or bool(inner[0](text)))

        checker.checks(name)(check)
    return checker


def validator_for(schema: Any) -> jsonschema.protocols.Validator:
    """A validator (formats checked where jsonschema can) for the schema's own draft.

    `$schema` decides; without it 2020-12, or 2019-09 when `items` is an array (the
    older spelling, which a 2020-12 validator cannot read).
    """
    default = jsonschema.Draft201909Validator if has_items_array(schema) else None
    cls = jsonschema.validators.validator_for(
        schema, default=default or jsonschema.Draft202012Validator
    )
    return cls(schema, format_checker=format_checker(cls))


def output_errors(schema: Any, instance: Any) -> list[str]:
    """Why `instance` breaks `schema` (JSON pointer: message), empty when it validates."""
    return [
        f"#/{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator_for(schema).iter_errors(instance)
    ]
