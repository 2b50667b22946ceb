"""String formats as exact patterns: every string a pattern accepts is valid for its format.

The patterns may accept less than the format's RFC allows (no leap seconds, no quoted email
local parts, no IPv6 with an embedded IPv4 tail, upper-case `T`/`Z` only): a constraint may
narrow what the model writes, never widen it. Each pattern is a full match (xgrammar anchors
`pattern` at both ends) written in the subset of regex syntax xgrammar compiles.
"""

from __future__ import annotations

_D2 = "[0-9]{2}"
_YEAR = "[0-9]{4}"
# Years divisible by 4 but not 100, or by 400 (the year as 4 digits).
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    f"|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])"
    f"|{_LEAP}-02-29)"
)
_HOUR, _MINUTE = "([01][0-9]|2[0-3])", "[0-5][0-9]"
# RFC 3339 full-time: the offset is required; seconds 00-59 (no leap second).
_TIME = f"{_HOUR}:{_MINUTE}:{_MINUTE}(\\.[0-9]{{1,9}})?(Z|[+-]{_HOUR}:{_MINUTE})"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = f"({_OCTET}\\.){{3}}{_OCTET}"
# RFC 1123 labels: letters, digits and inner hyphens; at most 3 labels.
# NOTE: the 63-character label limit is not in the pattern: a bounded repetition costs
# xgrammar 0.2.9 seconds of compile (6 s for {0,61}). The output check
# (grammars/schema/validation.py) enforces it instead: a longer label is an error, not a 200.
# Written so that each position has one reading (`[A-Za-z0-9](-*[A-Za-z0-9])*` is the same
# language and compiles about 5x slower in xgrammar 0.2.9).
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9]|)"
_HOSTNAME = f"{_LABEL}(\\.{_LABEL}){{0,2}}"
_HEX4 = "[0-9a-fA-F]{1,4}"
_B64 = "[A-Za-z0-9+/]"
# RFC 3986 characters allowed unescaped in a path segment, query or fragment.
_PCHAR = "([A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"


def _ipv6() -> str:
    """RFC 4291 text forms: eight groups, or `::` standing for one or more zero groups."""
    forms = [f"{_HEX4}(:{_HEX4}){{7}}"]
    # NOTE: `::` here stands for two or more zero groups (RFC 5952's rule), a subset.
    for before in range(7):
        for after in range(7 - before):
            forms.append(f"{_groups(before)}::{_groups(after)}")
    return "(" + "|".join(forms) + ")"


def _groups(n: int) -> str:
    """n colon-separated hex groups (empty for 0)."""
    if n == 0:
        return ""
    return _HEX4 if n == 1 else f"{_HEX4}(:{_HEX4}){{{n - 1}}}"


def _duration() -> str:
    """RFC 3339 appendix A: P, then date parts in order (Y M D), a time part, or weeks."""
    n = "[0-9]{1,9}"
    second = f"{n}S"
    minute = f"{n}M({second})?"
    hour = f"{n}H({minute})?"
    time = f"T({hour}|{minute}|{second})"
    day = f"{n}D"
    month = f"{n}M({day})?"
    year = f"{n}Y({month})?"
    return f"P((({day}|{month}|{year})({time})?)|{time}|{n}W)"


FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": f"^{_duration()}$",
    "ipv4": f"^{_IPV4}$",
    "ipv6": f"^{_ipv6()}$",
    "hostname": f"^{_HOSTNAME}$",
    "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    # Dot-atom local part (RFC 5321 without quoted strings) at a host name.
    "email": f"^[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+(\\.[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+)*"
    f"@{_HOSTNAME}$",
    # An absolute URI with an authority: scheme://host[:port][/path][?query][#fragment]. The
    # host is a host name (no IP literal: a narrowing); `(/pchar*)*` is written as one loop.
    # NOTE: both rewrites cut the compile (and the compiled grammar's size, which its JSON
    # trip from the compile worker pays again) by more than half.
    "uri": f"^[A-Za-z][A-Za-z0-9+.-]*://{_HOSTNAME}(:[0-9]{{1,5}})?"
    f"(/({_PCHAR}|/)*)?(\\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?$",
    # Canonical base64 (RFC 4648): padding bits zero, so each string decodes one way.
    "byte": f"^({_B64}{{4}})*({_B64}[AQgw]==|{_B64}{{2}}[AEIMQUYcgkosw048]=)?$",
}

# (shortest, longest) string each bounded pattern accepts: lengths a schema sets next to the
# format are then either implied (dropped) or refused.
FORMAT_LENGTHS: dict[str, tuple[int, int]] = {
    "date": (10, 10),
    "time": (9, 24),
    "date-time": (20, 35),
    "uuid": (36, 36),
    "ipv4": (7, 15),
    "ipv6": (2, 39),
}
# OpenAPI's numeric formats: (minimum, maximum), None where any number is allowed.
NUMBER_FORMATS: dict[str, tuple[int | None, int | None]] = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "float": (None, None),
    "double": (None, None),
}
