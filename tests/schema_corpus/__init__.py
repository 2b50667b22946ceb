"""Our own JSON-Schema corpus: per keyword class, a schema with valid and invalid instances.

Written for these tests (cases learned from reading the JSON-Schema-Test-Suite, none copied).
Each case is enforced (every `valid` instance is accepted token by token, every `invalid` one
refused) or, with `refused`, answered 400 naming that keyword. Instances are written in the
order the grammar emits properties (schema order, then required names not listed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.schema_corpus.combinators import COMBINATOR_CASES
from tests.schema_corpus.keywords import KEYWORD_CASES


@dataclass(frozen=True)
class Case:
    """One keyword class: its schema, instances it allows and forbids, or the refusal."""

    name: str
    schema: dict[str, Any]
    valid: list[Any] = field(default_factory=list)
    invalid: list[Any] = field(default_factory=list)
    # The keyword a strict request is refused for (then valid/invalid are not probed).
    refused: str | None = None


CASES: list[Case] = [Case(**c) for c in (*KEYWORD_CASES, *COMBINATOR_CASES)]
