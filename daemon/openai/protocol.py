"""OpenAI-compatible request parsing and response shapes (completions and chat)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from daemon.openai import validation
from daemon.openai.speculative_options import SpeculativeOptionError, parse_speculative
from daemon.openai.validation import ValidationError
from scheduling import SLO, SamplingParams, SamplingParamsError

MAX_N = 16
# Stop strings per request: each is searched in every delta's text (OpenAI allows 4).
MAX_STOP = 32
# max_tokens when a chat request gives none: generate until the context is full (the server
# lowers it to the room the prompt leaves).
UNTIL_CONTEXT_ENDS = 1 << 30


class APIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status; `param` names the field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def _get(
    body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None
) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; never accept it where a number is meant.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"{key}: expected {_name(types)}, got a boolean", key)
    if not isinstance(value, types):
        if isinstance(value, float) and value.is_integer() and int in _as_tuple(types):
            # orjson reads integers beyond 64 bits as floats: say what the client sent.
            raise APIError(400, f"{key}: integer {value:.0f} is out of range (64 bits)", key)
        raise APIError(400, f"{key}: expected {_name(types)}, got {type(value).__name__}", key)
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _name(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(
        {
            int: "integer",
            float: "number",
            str: "string",
            bool: "boolean",
            list: "array",
            dict: "object",
        }.get(t, t.__name__)
        for t in ts
    )


@dataclass(slots=True)
class GenerationRequest:
    """What the API layer hands the engine for one HTTP request."""

    prompts: list[str | list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    slo: SLO | None = None
    cache_salt: str | None = None
    model: str | None = None
    # Completions: int top-N; chat: top_logprobs with logprobs=true.
    logprobs: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_request(body: Any, chat: bool) -> GenerationRequest:
    """Validate a completions or chat body; APIError(400, field) on anything wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "body: expected a JSON object")
    try:
        return _parse_request(body, chat)
    except ValidationError as e:
        raise APIError(400, str(e), e.param) from None


def _parse_request(body: dict[str, Any], chat: bool) -> GenerationRequest:
    validation.check_fields(body, "chat" if chat else "completions")
    # SamplingParams' field -> the body field it came from, where the names differ.
    renamed: dict[str, str] = {}
    if not chat and body.get("tools") not in (None, []):
        raise APIError(400, "tools: only /v1/chat/completions takes tools", "tools")
    if chat:
        prompts: list[str | list[int]] = []  # filled by the server from the chat template
        max_tokens = _get(body, "max_completion_tokens", int)
        if max_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        else:
            max_tokens = _get(body, "max_tokens", int)
        wants_logprobs = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int)
        if top is not None and not wants_logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        logprobs = (top or 0) if wants_logprobs else None
        renamed["logprobs"] = "top_logprobs"
    else:
        prompts = _parse_prompt(body.get("prompt"))
        max_tokens = _get(body, "max_tokens", int, 16)
        logprobs = _get(body, "logprobs", int)
    if body.get("stream_options") is not None and not _get(body, "stream", bool, False):
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n: must be in [1, {MAX_N}], got {n}", "n")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop: expected a string or an array of strings", "stop")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} strings, got {len(stop)}", "stop")
    logit_bias = _get(body, "logit_bias", dict, {})
    try:
        bias = {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError):
        raise APIError(
            400, "logit_bias: keys must be token ids, values numbers", "logit_bias"
        ) from None
    seed = _get(body, "seed", int)
    validation.check_seed(seed)
    try:
        num_speculative_tokens = parse_speculative(body)
    except SpeculativeOptionError as e:
        raise APIError(400, str(e), e.param) from None
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else UNTIL_CONTEXT_ENDS,
            temperature=float(_get(body, "temperature", (int, float), 1.0)),
            top_p=float(_get(body, "top_p", (int, float), 1.0)),
            top_k=_get(body, "top_k", int, 0),
            min_p=float(_get(body, "min_p", (int, float), 0.0)),
            seed=seed,
            stop=stop,
            stop_token_ids=validation.int_list(body.get("stop_token_ids"), "stop_token_ids"),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            min_tokens=_get(body, "min_tokens", int, 0),
            presence_penalty=float(_get(body, "presence_penalty", (int, float), 0.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", (int, float), 0.0)),
            repetition_penalty=float(_get(body, "repetition_penalty", (int, float), 1.0)),
            logprobs=logprobs,
            logit_bias=bias,
            skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
            num_speculative_tokens=num_speculative_tokens,
        )
    except SamplingParamsError as e:
        param = renamed.get(e.field, e.field)
        message = str(e).replace(e.field, param, 1)
        raise APIError(400, message, param) from None
    slo = _parse_slo(_get(body, "slo", dict))
    options = _get(body, "stream_options", dict, {})
    return GenerationRequest(
        prompts=prompts,
        params=params,
        n=n,
        stream=_get(body, "stream", bool, False),
        include_usage=bool(options.get("include_usage")),
        priority=_get(body, "priority", int, 0),
        slo=slo,
        cache_salt=_get(body, "cache_salt", str),
        model=_get(body, "model", str),
        logprobs=logprobs,
        extra={"user": _get(body, "user", str)},
    )


def _parse_slo(slo: dict[str, Any] | None) -> SLO | None:
    if not slo:
        return None
    unknown = sorted(set(slo) - {"ttft_ms", "tpot_ms"})
    if unknown:
        raise APIError(400, f"slo: unknown field(s): {', '.join(unknown)}", "slo")
    values = {k: validation.number(slo.get(k), f"slo.{k}") for k in ("ttft_ms", "tpot_ms")}
    try:
        return SLO(**values)
    except ValueError as e:
        raise APIError(400, str(e), "slo") from None


def _parse_prompt(prompt: Any) -> list[str | list[int]]:
    """A string, an array of strings, an array of token ids, or an array of those."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise APIError(
        400,
        "prompt: expected a non-empty string, array of strings, or array of token ids",
        "prompt",
    )


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages as the template takes them; tool calls and results pass through."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: expected a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}]: expected an object with a role", "messages")
        _check_message(i, m)
        extra = _tool_fields(m, i)
        content = m.get("content")
        if content is None and "tool_calls" in extra:
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(
                    400, f"messages[{i}].content: only text parts are supported", "messages"
                )
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content: expected a string", "messages")
        out.append({"role": m["role"], "content": content, **extra})
    return out


def _check_message(i: int, m: dict[str, Any]) -> None:
    role = m["role"]
    if role in validation.CHAT_ROLES_NOT_SUPPORTED:
        raise APIError(400, f"messages[{i}].role: {role!r} is not supported", "messages")
    if role not in validation.CHAT_ROLES:
        roles = ", ".join(sorted(validation.CHAT_ROLES))
        raise APIError(
            400, f"messages[{i}].role: unknown role {role!r} (expected one of {roles})", "messages"
        )
    unknown = sorted(set(m) - validation.MESSAGE_FIELDS)
    if unknown:
        raise APIError(
            400, f"messages[{i}]: unknown or unsupported field(s): {', '.join(unknown)}", "messages"
        )


def _tool_fields(m: dict[str, Any], i: int) -> dict[str, Any]:
    """An assistant's `tool_calls` or a tool result's `tool_call_id`, checked."""
    extra: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls not in (None, []):
        ok = m["role"] == "assistant" and isinstance(calls, list)
        for call in calls if ok else []:
            fn = call.get("function") if isinstance(call, dict) else None
            ok = ok and isinstance(fn, dict) and isinstance(fn.get("name"), str)
            ok = ok and isinstance(fn.get("arguments", "{}"), str)
            ok = ok and _is_json(fn.get("arguments", "{}"))
        if not ok:
            raise APIError(
                400,
                f"messages[{i}].tool_calls: expected an assistant's array of "
                "{id, type: function, function: {name, arguments (JSON string)}}",
                "messages",
            )
        extra["tool_calls"] = calls
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise APIError(400, f"messages[{i}].tool_call_id: expected a string", "messages")
        extra["tool_call_id"] = m["tool_call_id"]
    return extra


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
