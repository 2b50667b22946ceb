"""Who a request is for: its tenant, and the per-tenant weights of the `fair` policy.

The tenant is the request's `user` field, else its `X-Tenant` header, else the name of the
API key it came with (`--api-key-file` lines `NAME KEY`), else the one shared tenant.
"""

from __future__ import annotations

import math

from scheduling import DEFAULT_TENANT

TENANT_HEADER = "X-Tenant"
MAX_TENANT_CHARS = 128


def resolve_tenant(user: str | None, header: str | None, key_name: str | None) -> str:
    """The first of `user`, the X-Tenant header and the API key's name that is set."""
    for where, value in (("user", user), (TENANT_HEADER, header), ("api key", key_name)):
        if value is None:
            continue
        value = value.strip()
        if not value:
            continue
        if len(value) > MAX_TENANT_CHARS:
            raise ValueError(f"{where}: a tenant name has at most {MAX_TENANT_CHARS} characters")
        return value
    return DEFAULT_TENANT


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """`--tenant-weights a=2,b=1`: each tenant's share under `fair` (others weigh 1)."""
    weights: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.strip().partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name.strip() or not weight > 0 or math.isinf(weight):
            raise ValueError(f"tenant_weights: {part.strip()!r} is not TENANT=WEIGHT (> 0)")
        weights[name.strip()] = weight
    return weights
