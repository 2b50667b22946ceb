"""Every budget and limit of the scheduler, with defaults a user can reason about."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step budgets and queue limits."""

    # Token budget of one step, prompt chunks, decode and draft tokens together.
    max_num_batched_tokens: int = 2048
    # Most requests in one step (and in the running set).
    max_num_seqs: int = 64
    # Longest prompt + output of one request; capped further by the KV pool's size.
    max_model_len: int = 4096
    # Most tokens one request may take in one step; 0 means the whole budget. Keeps one long
    # prompt from stalling decode for a full step.
    long_prefill_token_threshold: int = 0
    # Split prompts across steps; when off a prompt must fit the budget in one step.
    enable_chunked_prefill: bool = True
    # Fraction of KV blocks that admitting a waiting request must leave free, so running
    # requests can grow without preempting at once.
    watermark: float = 0.01
    # Slots reserved per running request for draft tokens (speculative decoding).
    num_lookahead_tokens: int = 0
    # Waiting requests beyond this are refused at add time (0 = unbounded); the API maps
    # the refusal to 429.
    max_waiting: int = 0
    # Most distinct LoRA adapters among running requests (the runner's resident slots);
    # 0 = no limit (no adapters served). A waiting request whose adapter would exceed it
    # waits; requests behind it still get in.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in (
            "long_prefill_token_threshold",
            "num_lookahead_tokens",
            "max_waiting",
            "max_loras",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens: must be >= max_model_len when chunked prefill is off"
            )
