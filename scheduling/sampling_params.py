"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it (the API answers 400 with it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


MAX_LOGPROBS = 20
# Below this a temperature is greedy (vLLM's rule): dividing logits by 1e-300 overflows
# them to inf, and the sampler's softmax turns that into NaN and garbage.
GREEDY_BELOW_TEMPERATURE = 1e-5
# A positive top_p below this keeps only the most likely token anyway (its probability is
# at least 1 / vocabulary size, and no vocabulary reaches 10^6): raised to it, since the
# float32 sampler reads 1e-320 as 0 and would then keep no token at all.
MIN_TOP_P = 1e-6
# No vocabulary is larger; beyond it a tensor of top_k values overflows int64.
MAX_TOP_K = (1 << 31) - 1
# Outside this a penalty scales logits to inf or 0 in float32: (0.01, 100) covers every
# value with an effect worth having (1.0 is off; 1.1-1.5 is usual).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping options, validated on construction.

    Defaults follow the OpenAI API: temperature 1, no top-k/top-p/min-p filtering.
    `top_k` of 0 or -1 disables top-k; `temperature` 0 means greedy.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Number of top alternatives to return per token; None returns no logprobs at all.
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    # Most draft tokens per step for this request when the engine speculates: 0 turns
    # speculation off for it, None takes the engine's --num-speculative-tokens.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature}",
        )
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        self.top_p = max(self.top_p, MIN_TOP_P)
        _check(
            -1 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"must be -1, 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}",
        )
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        low, high = REPETITION_PENALTY_RANGE
        _check(
            low <= self.repetition_penalty <= high,
            "repetition_penalty",
            f"must be in [{low}, {high}], got {self.repetition_penalty}",
        )
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            )
        for token_id, bias in self.logit_bias.items():
            _check(token_id >= 0, "logit_bias", f"token id must be >= 0, got {token_id}")
            _check(-100 <= bias <= 100, "logit_bias", f"bias must be in [-100, 100], got {bias}")
        if self.num_speculative_tokens is not None:
            _check(
                self.num_speculative_tokens >= 0,
                "num_speculative_tokens",
                f"must be >= 0, got {self.num_speculative_tokens}",
            )
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "token ids must be >= 0",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field, message)
