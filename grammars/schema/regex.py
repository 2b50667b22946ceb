"""Patterns in the dialect xgrammar compiles, with the meaning a validator gives them.

A JSON Schema `pattern` is an ECMA-262 regex that matches anywhere in the string
(`re.search`); xgrammar matches a pattern against the whole string and silently ignores
lookarounds and anchors in the middle. `full_match_pattern` rewrites a search pattern into an
equivalent (or narrower) full-match one and refuses what it cannot translate.
`guided_regex` (`regex_dot`) gets `.` without newline, as in Python and JavaScript.
"""

from __future__ import annotations

# Any character but line terminators: what `.` means in a JSON-schema pattern to xgrammar
# (and in JavaScript; a subset of Python's).
ANY_CHAR = "."
_META = set("\\^$.|?*+()[]{}/")


class PatternError(ValueError):
    """A pattern construct that cannot be enforced exactly; the message names it."""


def _scan(pattern: str) -> list[tuple[int, str, bool]]:
    """(index, character, inside a class) for each character that is not escaped."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append((i, pattern[i : i + 2], in_class))
            i += 2
            continue
        if in_class and c == "]":
            in_class = False
        elif not in_class and c == "[":
            in_class = True
            # `[]` and `[^]` begin with a literal `]` in Python; skip over it.
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            if pattern[j : j + 1] == "]":
                out.append((i, c, False))
                i = j + 1
                continue
        out.append((i, c, in_class))
        i += 1
    return out


def _check_supported(tokens: list[tuple[int, str, bool]]) -> None:
    for i, text, _ in tokens:
        if text in ("\\D", "\\W", "\\b", "\\B", "\\S") or (
            len(text) == 2 and text[0] == "\\" and text[1].isdigit() and text[1] != "0"
        ):
            # \D, \W, \S mean different sets in ECMA-262 and Python; xgrammar's are wider
            # than one of them. Backreferences and word boundaries are not regular.
            raise PatternError(f"{text!r} (at {i}) is not enforced exactly")
    for (i, text, in_class), nxt, after in zip(
        tokens, [*tokens[1:], (0, "", False)], [*tokens[2:], (0, "", False), (0, "", False)]
    ):
        if not in_class and text == "(" and nxt[1] == "?" and after[1] != ":":
            raise PatternError(f"group syntax '(?' (at {i}) is not supported (use (...))")
        if not in_class and text == ")" and nxt[1] == "?" and after[1] in ("?", "+"):
            raise PatternError(f"lazy or possessive '?' (at {nxt[0]}) is not supported")


def full_match_pattern(pattern: str) -> str:
    """A pattern xgrammar full-matches exactly where `re.search(pattern)` matches (or less)."""
    tokens = _scan(pattern)
    _check_supported(tokens)
    body_tokens = tokens
    starts = bool(body_tokens) and body_tokens[0][1] == "^"
    ends = bool(body_tokens) and body_tokens[-1][1] == "$" and not body_tokens[-1][2]
    start = 1 if starts else 0
    stop = body_tokens[-1][0] if ends else len(pattern)
    body = pattern[start:stop]
    inner = _scan(body)
    for i, text, in_class in inner:
        if not in_class and text in ("^", "$"):
            raise PatternError(
                f"anchor {text!r} inside the pattern (at {i + start}) is not enforced"
            )
    depth, alternation = 0, False
    for _, text, in_class in inner:
        if in_class:
            continue
        depth += text == "("
        depth -= text == ")"
        alternation |= text == "|" and depth == 0
    body = optional_groups(_with_dot(body, inner, "."))
    if alternation:
        # Each alternative matched whole: a subset of the search (which may add text around).
        return f"^({body})$"
    return f"^{'' if starts else '.*'}({body}){'' if ends else '.*'}$"


def _with_dot(pattern: str, tokens: list[tuple[int, str, bool]], dot: str) -> str:
    """`pattern` with every unescaped `.` outside a class replaced by `dot`."""
    out, last = [], 0
    for i, text, in_class in tokens:
        if text == "." and not in_class:
            out.append(pattern[last:i])
            out.append(dot)
            last = i + 1
    out.append(pattern[last:])
    return "".join(out)


def optional_groups(pattern: str) -> str:
    """Every optional group `(X)?` written `(X|)`.

    NOTE: xgrammar 0.2.9 compiles `(X)?` wrongly when X holds a quantifier (`(\\.[0-9]+)?`
    also accepts the digits without the dot); `(X|)` means the same and compiles right.
    """
    tokens = _scan(pattern)
    out, last = [], 0
    for (i, text, in_class), nxt in zip(tokens, [*tokens[1:], (len(pattern), "", False)]):
        if not in_class and text == ")" and nxt[1] == "?":
            out.append(pattern[last:i])
            out.append("|)")
            last = nxt[0] + 1
    out.append(pattern[last:])
    return "".join(out)


def regex_dot(pattern: str) -> str:
    """A `guided_regex` with `.` matching anything but a newline, unless it starts `(?s)`.

    Optional groups are rewritten as in `optional_groups` (the same xgrammar fault).
    """
    if pattern.startswith("(?s)"):
        body = pattern[4:]
        return "(" + optional_groups(_with_dot(body, _scan(body), "[\\s\\S]")) + ")"
    return optional_groups(_with_dot(pattern, _scan(pattern), "[^\\n]"))


def escape(text: str) -> str:
    """`text` as a pattern matching exactly it."""
    return "".join("\\" + c if c in _META else _char(c) for c in text)


def _char(c: str) -> str:
    return c if c.isprintable() else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c


def not_any_of(words: list[str]) -> str:
    """A full-match pattern for every string (of ANY_CHAR) that is none of `words`.

    Built on the words' trie: a string either leaves the trie (a trie prefix, then a
    character no word continues with there, then anything) or ends on a trie node that is
    not a word. NOTE: the one shared `.*` tail keeps xgrammar's automaton small; a tail per
    node (the first way this was written) made the grammar twice as large.
    """
    trie: dict[str, dict] = {}
    for w in set(words):
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[""] = {}
    ends = _trie_ends(trie)
    return f"^({_trie_exits(trie)}{ANY_CHAR}*{'|' + ends if ends else ''})$"


def _children(node: dict[str, dict]) -> list[str]:
    return sorted(c for c in node if c)


def _trie_exits(node: dict[str, dict]) -> str:
    """The strings that leave the trie at their last character."""
    children = _children(node)
    excluded = "".join(escape(c) if c not in "]^-" else "\\" + c for c in children)
    alts = [f"[^\\n\\r\\u2028\\u2029{excluded}]"]
    alts += [f"{escape(c)}{_trie_exits(node[c])}" for c in children]
    return "(" + "|".join(alts) + ")"


def _trie_ends(node: dict[str, dict]) -> str | None:
    """The trie prefixes that are not words (None: there are none under `node`)."""
    alts = [] if "" in node else ["()"]
    for c in _children(node):
        below = _trie_ends(node[c])
        if below is not None:
            alts.append(f"{escape(c)}{below}")
    return "(" + "|".join(alts) + ")" if alts else None
