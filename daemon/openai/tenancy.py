"""Who a request is for: the tenant the `fair` policy shares the engine between.

The tenant is the request's `user` field, else its `X-Tenant` header, else the name of the
API key it came with (`--api-key-file` lines `NAME KEY`), else the one shared tenant.
"""

from __future__ import annotations

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
