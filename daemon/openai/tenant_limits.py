"""Per-tenant token-rate limits (`--tenant-rate-limits a=2000,*=500`), answered 429.

A token bucket per tenant, refilled at the tenant's rate up to `burst_s` seconds of it. A
request takes its prompt tokens plus max_tokens when it is queued, and gives back what it
did not generate when it ends, so a tenant is held to what it actually used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# The key of the limit that applies to every tenant not named.
ANY_TENANT = "*"
# Buckets of tenants not seen for this long are forgotten (tenant names come from clients).
IDLE_FORGET_S = 600.0


class TenantLimitError(Exception):
    """A tenant is over its token rate: the API answers 429 with `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def parse_rate_limits(text: str | None) -> dict[str, float]:
    """`NAME=TOKENS_PER_S,...` (`*` for every other tenant); empty or None: no limits."""
    limits: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.strip().partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if not sep or not name or not rate > 0 or math.isinf(rate):
            raise ValueError(f"tenant_rate_limits: {part.strip()!r} is not NAME=TOKENS_PER_S (> 0)")
        limits[name] = rate
    return limits


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class TenantRateLimiter:
    """Token buckets per tenant; `take` raises TenantLimitError, `give_back` refunds."""

    def __init__(
        self,
        limits: dict[str, float],
        burst_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = dict(limits)
        self.burst_s = burst_s
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def __bool__(self) -> bool:
        return bool(self.limits)

    def rate(self, tenant: str) -> float | None:
        return self.limits.get(tenant, self.limits.get(ANY_TENANT))

    def take(self, tenant: str, tokens: int) -> None:
        """Charge `tokens` to `tenant`, or raise with the wait until they would fit."""
        rate = self.rate(tenant)
        if rate is None:
            return
        capacity = rate * self.burst_s
        if tokens > capacity:
            raise ValueError(
                f"max_tokens: prompt + max_tokens = {tokens} tokens exceed tenant {tenant!r}'s "
                f"limit of {rate:g} tokens/s x {self.burst_s:g} s burst; ask for fewer"
            )
        bucket = self._refill(tenant, rate, capacity)
        if bucket.tokens < tokens:
            wait = math.ceil((tokens - bucket.tokens) / rate)
            raise TenantLimitError(
                f"tenant {tenant!r} is over its limit of {rate:g} tokens/s "
                f"(this request needs {tokens}, {bucket.tokens:.0f} are free)",
                max(1, wait),
            )
        bucket.tokens -= tokens

    def give_back(self, tenant: str, tokens: int) -> None:
        """Return tokens a request was charged for and did not use."""
        rate = self.rate(tenant)
        bucket = self._buckets.get(tenant)
        if rate is None or bucket is None or tokens <= 0:
            return
        bucket.tokens = min(rate * self.burst_s, bucket.tokens + tokens)

    def _refill(self, tenant: str, rate: float, capacity: float) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) > 1024:
                self._forget_idle(now)
            bucket = self._buckets[tenant] = _Bucket(capacity, now)
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        return bucket

    def _forget_idle(self, now: float) -> None:
        self._buckets = {t: b for t, b in self._buckets.items() if now - b.updated < IDLE_FORGET_S}
