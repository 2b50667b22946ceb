"""What each endpoint accepts, checked before a request reaches the engine.

One allow-list per endpoint. A field outside it answers 400 naming it (as the OpenAI API
does), so a misspelt `max_token` is never silently ignored. The lists are built from:

- the OpenAI fields of the endpoint that headrace implements;
- `VLLM_EXTRA_FIELDS`: vLLM's sampling extras that headrace implements the same way, plus
  headrace's own `slo` and `cache_salt`;
- `STRUCTURED_FIELDS` and `TOOL_FIELDS`: structured output (OpenAI's and vLLM's names) and
  tool calls, checked in detail by daemon/openai/structured_output.py and daemon/openai/tools.py;
- `NOT_SUPPORTED`: fields that are known but not planned; 400 unless the no-op value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMMON_FIELDS = frozenset(
    {
        "model",
        "n",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "user",
    }
)

# vLLM's extra sampling parameters (same names and meaning), and headrace's own.
VLLM_EXTRA_FIELDS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "skip_special_tokens",
        "priority",
        "cache_salt",
        "prompt_logprobs",
        # headrace: {"ttft_ms": number, "tpot_ms": number} for the `slo` policy.
        "slo",
        # headrace: {"enabled": bool, "num_speculative_tokens": int} (speculative decoding).
        "speculative",
    }
)


def _is_none(value: Any) -> bool:
    return value is None


def _is_empty(value: Any) -> bool:
    return value in (None, [], {})


# Structured output (grammars/) and tool calls (daemon/openai/tools.py).
STRUCTURED_FIELDS = frozenset(
    {
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    }
)
TOOL_FIELDS = frozenset({"tools", "tool_choice"})

# Known, not planned: 400 unless the no-op value.
NOT_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _is_none,
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "functions": _is_empty,
    "function_call": lambda v: v in (None, "none"),
    # Needs the logits of every prompt position from the runner; not implemented.
    "prompt_logprobs": _is_none,
}

COMPLETION_FIELDS = frozenset(
    COMMON_FIELDS | VLLM_EXTRA_FIELDS | {"prompt", "echo", "best_of", "suffix"} | STRUCTURED_FIELDS
)
CHAT_FIELDS = frozenset(
    COMMON_FIELDS
    | VLLM_EXTRA_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs", "functions", "function_call"}
    | STRUCTURED_FIELDS
    | TOOL_FIELDS
)
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})

FIELDS = {
    "completions": COMPLETION_FIELDS,
    "chat": CHAT_FIELDS,
    "tokenize": TOKENIZE_FIELDS,
    "detokenize": DETOKENIZE_FIELDS,
}

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The legacy role of the legacy `functions` API.
CHAT_ROLES_NOT_SUPPORTED = frozenset({"function"})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})

# torch.Generator takes seeds in [-2**63, 2**64).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class ValidationError(ValueError):
    """A field is wrong; `param` names it. The API layer turns it into a 400."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """Unknown fields first (all named at once), then known fields we do not honour."""
    unknown = sorted(k for k in body if k not in FIELDS[endpoint])
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValidationError(unknown[0], f"unknown field(s): {names}")
    for key, is_noop in NOT_SUPPORTED.items():
        if key in body and not is_noop(body[key]):
            raise ValidationError(key, f"{key}: not supported")


def check_seed(seed: int | None) -> None:
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise ValidationError("seed", f"seed: must be in [{SEED_MIN}, {SEED_MAX}], got {seed}")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of the index-th of n choices: seed + index, wrapped to stay in range."""
    if seed is None or index == 0:
        return seed
    value = seed + index
    return value - (1 << 64) if value > SEED_MAX else value


def int_list(value: Any, param: str) -> list[int]:
    """A JSON array of integers (not booleans), or a 400 naming `param`."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValidationError(param, f"{param}: expected an array of integers")
    return value


def number(value: Any, param: str) -> float | None:
    """A JSON number (not a boolean) or null, or a 400 naming `param`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(param, f"{param}: expected a number, got {type(value).__name__}")
    return float(value)
