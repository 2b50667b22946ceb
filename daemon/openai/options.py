"""The API layer's limits and access settings (a plain dataclass; ServerConfig fills it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class APIOptions:
    """What the HTTP layer enforces around the engine."""

    # Bodies above this answer 413 before they are read whole.
    max_request_bytes: int = 8 << 20
    # When set, every route but /health needs `Authorization: Bearer <key>`.
    api_key: str | None = None
    # More accepted keys, each with the tenant it names (None: unnamed; --api-key-file).
    api_keys: dict[str, str | None] = field(default_factory=dict)
    # Per-tenant token rates (tokens/s; "*" for every tenant not named): over it, 429.
    tenant_rate_limits: dict[str, float] = field(default_factory=dict)
    # Tenants with their own label in /metrics (by recent traffic); the rest are "other".
    tenant_metrics_top_k: int = 8
    # /metrics answers only on the Unix socket (file mode and group control who reads it).
    metrics_unix_only: bool = False
    # Log prompt text (never logged otherwise).
    log_prompts: bool = False
    # A request body not read whole within this many seconds answers 408 (a slow sender).
    body_timeout: float = 30.0
    # A stream whose client has not taken a chunk for this long is ended (slow reader).
    stream_timeout: float = 60.0
    # Prompts (or chat messages) longer than this many characters are tokenized on a
    # worker thread, so the event loop keeps serving meanwhile.
    offload_chars: int = 4096
    # The `headrace.tool_parsers` entry that reads tool calls out of "auto" answers.
    tool_parser: str = "hermes"
