"""What one request's constraint may cost before anything compiles: size limits per kind.

A compiled grammar's size and compile time grow with its text (a 300 KB choice list pins
~75 MiB and compiles for seconds), so the text is bounded per request, before it reaches a
compile worker. The compile time limit (grammars/compile_pool.py) covers what a short text
can still cost (`[a-z]{1,20000}` is 14 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from grammars.spec import GrammarError, GrammarSpec


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Largest constraint one request may send; 0 turns a limit off."""

    # Bytes of the constraint's canonical text: the schema as compact JSON, the regex, the
    # EBNF, or all choices together (UTF-8).
    max_bytes: int = 64 << 10
    # Most strings in one choice list.
    max_choices: int = 1024


def check_size(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """GrammarError naming the kind and the limit when `spec` is larger than `limits` allow.

    The message starts with the kind's field ("choice: ..."), like the compiler's own; the
    API prefixes the request field the constraint came from.
    """
    if spec.kind == "json":
        return
    if spec.kind == "choice":
        choices = orjson.loads(spec.text)
        if limits.max_choices and len(choices) > limits.max_choices:
            raise GrammarError(
                f"choice: {len(choices)} choices, more than the limit of {limits.max_choices}"
            )
        size = sum(len(c.encode()) for c in choices)
        what = "all choices together are"
    else:
        size = len(spec.text.encode())
        what = {"json_schema": "the schema", "regex": "the pattern", "grammar": "the grammar"}[
            spec.kind
        ] + " is"
    if limits.max_bytes and size > limits.max_bytes:
        field = "schema" if spec.kind == "json_schema" else spec.kind
        raise GrammarError(
            f"{field}: {what} {size} bytes, more than the limit of "
            f"{limits.max_bytes} (--grammar-max-bytes)"
        )
