"""One grammar compile worker process: receives (kind, text), answers the compiled grammar.

It runs in its own process so that a compile can be stopped: xgrammar compiles in C++ and
cannot be interrupted in a thread, so a compile past its time limit (or one nobody waits for
any more) is ended by killing this process (grammars/compile_pool.py starts another).

Started as `python -m grammars.compile_worker FD` (FD: its end of a socket pair); protocol
over a multiprocessing Connection:
  parent -> child  the TokenizerInfo as JSON, once; child -> parent ("ready", "")
  parent -> child  (kind, text)
  child -> parent  ("ok", CompiledGrammar.serialize_json()) | ("error", message)
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from multiprocessing.connection import Connection

import xgrammar as xgr

from grammars.compile_pool import release_freed_memory
from grammars.schema.regex import regex_dot
from grammars.spec import GrammarError, GrammarSpec, clean_compiler_message

# Which request field the compiler's complaint is about.
FIELD = {
    "json": "json",
    "json_schema": "schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def compile_spec(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """Compile `spec`; GrammarError (naming the kind) when it is invalid or generates nothing."""
    try:
        compiled = _compile(compiler, spec)
    except GrammarError:
        raise
    except Exception as e:
        raise GrammarError(f"{FIELD[spec.kind]}: {clean_compiler_message(e)}") from None
    check_generates_something(compiled, spec)
    return compiled


def _compile(c: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    if spec.kind == "json":
        return c.compile_builtin_json_grammar()
    if spec.kind == "json_schema":
        return c.compile_json_schema(
            spec.text, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )
    if spec.kind == "regex":
        return c.compile_regex(regex_dot(spec.text))
    if spec.kind == "choice":
        return c.compile_grammar(spec.ebnf())
    if spec.kind == "grammar":
        return c.compile_grammar(spec.text)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def check_generates_something(compiled: xgr.CompiledGrammar, spec: GrammarSpec) -> None:
    """Refuse a grammar that allows no token and cannot end at its start.

    `root ::= x` / `x ::= x "a"` compiles, but no finite sentence exists: every request would
    run to max_tokens with nothing generated. NOTE: only the start is checked; a grammar that
    dead-ends after a valid prefix is not found here.
    """
    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_completed():
        return
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise GrammarError(
            f"{FIELD[spec.kind]}: the grammar has no finite sentence (no token may start it "
            "and it cannot be empty); check for rules that only refer to themselves"
        )


def serve(conn: Connection) -> None:
    """The worker's main loop: the vocabulary first, then compile what arrives until the
    parent closes its end."""
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiled = compile_spec(compiler, GrammarSpec(kind, text))
            answer = compiled.serialize_json()
            del compiled
            conn.send(("ok", answer))
            del answer
            release_freed_memory()
        except GrammarError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # anything else is still this grammar's fault, not the pool's
            conn.send(("error", f"{FIELD.get(kind, kind)}: {clean_compiler_message(e)}"))


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the daemon dies, even mid-compile."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1

if __name__ == "__main__":
    _die_with_parent()
    serve(Connection(int(sys.argv[1])))
