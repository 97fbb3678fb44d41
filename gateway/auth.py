"""Bearer auth: API key -> tenant. With no keys configured, auth is off and every request
belongs to the default tenant. Tenant names scope everything a tenant creates later
(adapters, sessions)."""

from __future__ import annotations

import hmac

from gateway.config import DEFAULT_TENANT
from gateway.errors import unauthorized


class Authenticator:
    def __init__(self, api_keys: dict[str, str] | None):
        self.api_keys = api_keys

    @property
    def enabled(self) -> bool:
        return self.api_keys is not None

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` header value; raises a 401 `APIError`."""
        if self.api_keys is None:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            )
        for known, tenant in self.api_keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise unauthorized(f"Incorrect API key provided: {_redact(key)}.")


def _redact(key: str) -> str:
    return key[:3] + "*" * max(0, min(len(key) - 7, 20)) + key[-4:] if len(key) > 8 else "***"
