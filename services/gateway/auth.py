"""API keys at the gateway: which key may act for which tenants (no gRPC here)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from llmesh.errors import PermissionDenied, Unauthenticated

ANY_TENANT = "*"


@dataclass(frozen=True)
class ApiKeys:
    """Keys as sha256 digests -> tenants they own. Empty means authentication is off."""

    owners: dict[str, frozenset[str]]

    @classmethod
    def parse(cls, raw: str) -> ApiKeys:
        """`key1=acme|beta;key2=*` (a key may own several tenants; `*` owns all)."""
        owners: dict[str, frozenset[str]] = {}
        for item in raw.split(";"):
            item = item.strip()
            if not item:
                continue
            key, sep, tenants = item.partition("=")
            if not sep or not key.strip() or not tenants.strip():
                raise ValueError("expected key=tenant|tenant;key2=* (one entry per key)")
            if len(key.strip()) < 16:
                raise ValueError("API keys must be at least 16 characters")
            owners[_digest(key.strip())] = frozenset(t.strip() for t in tenants.split("|") if t.strip())
        return cls(owners)

    @property
    def enabled(self) -> bool:
        return bool(self.owners)

    def authorize(self, authorization: str | None, tenant: str) -> None:
        """Raises Unauthenticated without a known key, PermissionDenied for a tenant it does not own."""
        if self.enabled:
            _check_owned(self.authenticate(authorization), tenant)

    def tenant_of(self, authorization: str | None, requested: str = "") -> str:
        """The tenant a request acts for: the one it names, else its key's only tenant, else
        "default"; authorized as `authorize` does."""
        owned = self.authenticate(authorization)
        only = next(iter(owned)) if len(owned) == 1 and ANY_TENANT not in owned else ""
        tenant = requested or only or "default"
        _check_owned(owned, tenant)
        return tenant

    def authenticate(self, authorization: str | None) -> frozenset[str]:
        """The tenants the caller's key owns; Unauthenticated without a known key (keys on)."""
        if not self.enabled:
            return frozenset({ANY_TENANT})
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("missing API key: send `authorization: Bearer <key>`", reason="API_KEY_MISSING")
        digest = _digest(token.strip())
        tenants = next((t for d, t in self.owners.items() if hmac.compare_digest(d, digest)), None)
        if tenants is None:
            raise Unauthenticated("unknown API key", reason="API_KEY_INVALID")
        return tenants


def _check_owned(owned: frozenset[str], tenant: str) -> None:
    if ANY_TENANT not in owned and tenant not in owned:
        raise PermissionDenied(f"this API key may not act for tenant {tenant!r}", reason="TENANT_NOT_OWNED")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
