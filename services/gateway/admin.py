"""Admin keys at the gateway: who may purge cached answers (no gRPC here).

Separate from the tenants' API keys (services/gateway/auth.py): an admin key acts on the
mesh itself, for any tenant, and nothing else. With none configured every admin call is
refused, also while tenant authentication is off.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from llmesh.errors import PermissionDenied, Unauthenticated

MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class AdminKeys:
    """sha256 digests of the admin keys."""

    digests: frozenset[str]

    @classmethod
    def parse(cls, raw: str) -> AdminKeys:
        """`key1,key2`: each at least MIN_KEY_CHARS characters."""
        keys = [k.strip() for k in raw.split(",") if k.strip()]
        if any(len(k) < MIN_KEY_CHARS for k in keys):
            raise ValueError(f"admin keys must be at least {MIN_KEY_CHARS} characters")
        return cls(frozenset(_digest(k) for k in keys))

    def authorize(self, authorization: str | None) -> None:
        """Raises PermissionDenied while no admin key is configured, Unauthenticated without one
        of them (`authorization: Bearer <admin key>`)."""
        if not self.digests:
            raise PermissionDenied("no admin key is configured (LLMESH_ADMIN_KEYS)", reason="ADMIN_KEYS_OFF")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                "missing admin key: send `authorization: Bearer <admin key>`", reason="ADMIN_KEY_MISSING"
            )
        digest = _digest(token.strip())
        if not any(hmac.compare_digest(d, digest) for d in self.digests):
            raise Unauthenticated("not an admin key", reason="ADMIN_KEY_INVALID")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
