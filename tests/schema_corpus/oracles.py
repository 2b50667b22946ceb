"""Format checks written independently of grammars/schema/formats.py (stdlib parsers).

jsonschema's FormatChecker skips formats whose optional libraries are missing; these make
every enforced format checked when the tests validate generated outputs.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import re
import urllib.parse
import uuid

import jsonschema

from grammars.schema.validation import validator_for

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _hostname(text: str) -> bool:
    return len(text) <= 253 and all(_LABEL.fullmatch(label) for label in text.split("."))


def _date_time(text: str) -> bool:
    date, sep, time = text.partition("T")
    return sep == "T" and _date(date) and _time(time)


def _date(text: str) -> bool:
    try:
        return len(text) == 10 and datetime.date.fromisoformat(text) is not None
    except ValueError:
        return False


def _time(text: str) -> bool:
    if not re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", text):
        return False
    try:
        return datetime.time.fromisoformat(text.replace("Z", "+00:00")) is not None
    except ValueError:
        return False


def _duration(text: str) -> bool:
    """RFC 3339 appendix A, read left to right."""
    if not text.startswith("P") or text == "P":
        return False
    date, _, time = text[1:].partition("T")
    if "T" in text and not time:
        return False
    if re.fullmatch(r"\d+W", date) and not time:
        return True
    return _ordered(date, "YMD") and _ordered(time, "HMS")


def _ordered(part: str, units: str) -> bool:
    """Digits+unit pieces in `units` order and contiguous (Y then M then D, ...)."""
    pieces = re.findall(r"(\d+)([A-Z])", part)
    if "".join(n + u for n, u in pieces) != part:
        return False
    found = [units.index(u) for _, u in pieces if u in units]
    if not pieces:
        return True
    return len(found) == len(pieces) and found == list(range(found[0], found[0] + len(found)))


def _uri(text: str) -> bool:
    parts = urllib.parse.urlsplit(text)
    allowed = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@/?#%-]*")
    return bool(parts.scheme and parts.netloc) and bool(allowed.fullmatch(text))


def _byte(text: str) -> bool:
    try:
        return base64.b64encode(base64.b64decode(text, validate=True)).decode() == text
    except ValueError:
        return False


def _email(text: str) -> bool:
    local, at, domain = text.rpartition("@")
    atoms = local.split(".")
    plain = all(a and not set(a) & set(' "(),:;<>@[\\]') for a in atoms)
    return bool(at and plain and _hostname(domain))


def _uuid(text: str) -> bool:
    try:
        return len(text) == 36 and str(uuid.UUID(text)) == text.lower()
    except ValueError:
        return False


def _ip(version: int):
    def check(text: str) -> bool:
        try:
            return ipaddress.ip_address(text).version == version
        except ValueError:
            return False

    return check


def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


CHECKS = {
    "int32": _int32,
    "date": _date, "time": _time, "date-time": _date_time, "duration": _duration,
    "email": _email, "uri": _uri, "uuid": _uuid, "ipv4": _ip(4), "ipv6": _ip(6),
    "hostname": _hostname, "byte": _byte,
}  # fmt: skip


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checker with every enforced format checked by the functions above."""
    checker = jsonschema.FormatChecker()
    for name, check in CHECKS.items():
        checker.checks(name)(check)
    return checker


def validate(instance: object, schema: dict) -> bool:
    validator = validator_for(schema)
    return type(validator)(schema, format_checker=format_checker()).is_valid(instance)
