"""The safety net under strict: a finished output is validated before it counts as success.

The grammar should make an invalid output impossible (grammars/schema/); this check does not
trust that. Every strict json_schema output that ended with `stop` (one cut by max_tokens
already says `length`) is validated with jsonschema against the schema as the client sent
it. A failure is counted in `headrace_grammar_validation_failures_total` and answered as an
error: a 500 for a plain request, an SSE error event before `[DONE]` for a stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from grammars.schema.validation import output_errors


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def loads(text: str) -> Any:
    """JSON as RFC 8259 writes it. orjson refuses numbers past a double's range (1e999),
    which the JSON grammar allows and a model may write: those documents are read by the
    standard library instead (1e999 becomes inf; NaN and Infinity stay refused)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        if "number" not in str(e):
            raise
        return json.loads(text, parse_constant=_no_constant)


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """The schema a strict output must validate against, as the client sent it."""

    schema: Any

    def errors(self, text: str) -> list[str]:
        """Why `text` fails the schema (empty when it validates)."""
        try:
            instance = loads(text)
        except ValueError as e:  # orjson's and json's decode errors are both ValueErrors
            return [f"not JSON: {e}"]
        try:
            return output_errors(self.schema, instance)
        except Exception as e:  # a schema jsonschema cannot read never passes as valid
            return [f"cannot validate: {e}"]

    def failure(self, text: str, finish_reason: str | None) -> str | None:
        """The error message for an output that ended `stop` and fails; else None."""
        if finish_reason != "stop":
            return None
        errors = self.errors(text)
        if not errors:
            return None
        return f"output failed schema validation under strict: {'; '.join(errors[:3])}"
