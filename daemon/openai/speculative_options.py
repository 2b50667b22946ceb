"""The per-request speculative-decoding extension of the OpenAI request body.

```json
"speculative": {"enabled": false}              // this request never speculates
"speculative": {"num_speculative_tokens": 2}   // at most 2 drafts per step (<= the engine's k)
```
Both keys are optional; the object is ignored when the engine does not speculate.
"""

from __future__ import annotations

from typing import Any

FIELD = "speculative"
KEYS = ("enabled", "num_speculative_tokens")


class SpeculativeOptionError(ValueError):
    """A bad `speculative` object; `param` names the field for the 400 answer."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def parse_speculative(body: dict[str, Any]) -> int | None:
    """The request's draft cap for SamplingParams.num_speculative_tokens: 0 (opted out),
    a number, or None (the engine's default)."""
    value = body.get(FIELD)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpeculativeOptionError(FIELD, f"expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise SpeculativeOptionError(
            f"{FIELD}.{unknown[0]}", f"unknown field; allowed: {', '.join(KEYS)}"
        )
    enabled = value.get("enabled", True)
    if not isinstance(enabled, bool):
        raise SpeculativeOptionError(f"{FIELD}.enabled", "expected a boolean")
    k = value.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise SpeculativeOptionError(
            f"{FIELD}.num_speculative_tokens", f"expected an integer >= 0, got {k!r}"
        )
    return 0 if not enabled else k
