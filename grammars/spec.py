"""What a request asks its output to obey: a kind and the text that describes it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import orjson

from grammars.schema_support import check_schema

GrammarKind = Literal["json", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[GrammarKind, ...] = ("json", "json_schema", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names what is wrong (the API: 400)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint in canonical text form, so equal constraints share a cache entry.

    - json: any JSON value (`text` is empty)
    - json_schema: the schema as compact JSON (key order kept: it is the output's order)
    - regex: the pattern
    - choice: a JSON array of the allowed strings
    - grammar: EBNF/GBNF text whose start rule is `root`
    """

    kind: GrammarKind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: object) -> GrammarSpec:
        """A strict JSON-schema constraint: GrammarError names any keyword not enforced."""
        return cls.checked_json_schema(schema, strict=True)[0]

    @classmethod
    def checked_json_schema(cls, schema: object, strict: bool) -> tuple[GrammarSpec, list[str]]:
        """The constraint and the unenforced keywords dropped from it (only when not strict).

        See grammars/schema_support.py for the keywords and the loose formats rewritten.
        """
        if isinstance(schema, str):
            try:
                schema = orjson.loads(schema)
            except orjson.JSONDecodeError as e:
                raise GrammarError(f"schema: invalid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("schema: expected a JSON object")
        try:
            checked, dropped = check_schema(schema, strict)
        except ValueError as e:
            raise GrammarError(f"schema: {e}") from None
        return cls("json_schema", orjson.dumps(checked).decode()), dropped

    @classmethod
    def choice(cls, choices: object) -> GrammarSpec:
        if not isinstance(choices, list) or not choices:
            raise GrammarError("choice: expected a non-empty array of strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice: every choice must be a non-empty string")
        return cls("choice", orjson.dumps(choices).decode())

    def ebnf(self) -> str:
        """The EBNF of a choice list: one alternative per choice, each a quoted literal."""
        assert self.kind == "choice"
        choices = orjson.loads(self.text)
        return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    # JSON string escapes are also EBNF literal escapes (\" \\ \n \t \uXXXX).
    return orjson.dumps(text).decode()


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: (Check failed: .*? is false: )?")


def clean_compiler_message(error: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ file and line)."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    first = _XGRAMMAR_LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__
    return first.strip()
