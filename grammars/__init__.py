"""Structured output: grammar compile cache, per-request matchers, token bitmasks."""

from grammars.compiler import CompileStats, GrammarCompiler
from grammars.matcher import GrammarState, allocate_bitmask, apply_bitmask
from grammars.schema_support import ENFORCED_FORMATS, UNENFORCED_KEYWORDS, check_schema
from grammars.spec import KINDS, GrammarError, GrammarKind, GrammarSpec

__all__ = [
    "ENFORCED_FORMATS",
    "KINDS",
    "UNENFORCED_KEYWORDS",
    "CompileStats",
    "GrammarCompiler",
    "GrammarError",
    "GrammarKind",
    "GrammarSpec",
    "GrammarState",
    "allocate_bitmask",
    "apply_bitmask",
    "check_schema",
]
