"""The strict rule for JSON Schemas: enforced exactly, or refused naming keyword + pointer.

grammars/schema/ normalises the schema (refs, types, allOf/oneOf/not/if, formats) into the
keywords xgrammar 0.2.9 enforces exactly (tests/test_schema_corpus.py pins every keyword
class: valid instance accepted, invalid refused token by token). What it cannot enforce is
never silently ignored: with `strict` the request is refused naming it; without, it is
dropped and the response says so.
"""

from __future__ import annotations

from typing import Any

from grammars.schema import SchemaRefusal, normalize_schema
from grammars.schema.formats import FORMAT_PATTERNS, NUMBER_FORMATS
from grammars.schema.normalize import UNENFORCED

# keyword -> why it is not enforced.
UNENFORCED_KEYWORDS: dict[str, str] = dict(UNENFORCED)
# String (and OpenAPI number) formats enforced exactly; any other format is refused.
ENFORCED_FORMATS = frozenset(FORMAT_PATTERNS) | frozenset(NUMBER_FORMATS)


def check_schema(schema: Any, strict: bool) -> tuple[Any, list[str]]:
    """The schema to compile and the keywords dropped from it.

    strict: raise ValueError naming the first unenforced keyword and where it is.
    Not strict: drop every unenforced keyword and list them.
    """
    try:
        return normalize_schema(schema, strict)
    except SchemaRefusal as e:
        if strict:
            raise ValueError(
                f"{e}; remove it or send strict: false to drop it with a warning"
            ) from None
        raise ValueError(str(e)) from None
