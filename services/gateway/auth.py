"""API keys at the gateway: who is calling (a key's id, never the key), for which tenants, with
which models and limits (no gRPC here).

Keys come from LLMESH_API_KEYS (`key=tenant|tenant;key2=*`, no limits) and from the keys file
LLMESH_API_KEYS_FILE (see llmesh.keys_file), which `KeyRing.watch` re-reads when it changes: a
key added or revoked there works within a poll interval, without a restart. A file that fails
to parse leaves the keys as they were (logged, counted), never an open gateway.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from llmesh import keys_file
from llmesh.errors import PermissionDenied, Unauthenticated

ANY_TENANT = "*"
log = logging.getLogger("llmesh.gateway")

KEYS_LOADED = Gauge("llmesh_gateway_api_keys", "API keys the gateway accepts, by where they come from.", ["source"])
KEYS_FILE_VALID = Gauge(
    "llmesh_gateway_api_keys_file_valid",
    "1 while the API keys file on disk is the one in force; 0 after a change failed to parse (the previous "
    "keys stay in force).",
)
KEYS_RELOADS = Counter(
    "llmesh_gateway_api_keys_reloads", "Re-reads of the API keys file after it changed, by result.", ["result"]
)


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; 0 is no limit. Tokens are generated ones (prompt + completion)."""

    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens per minute
    tpd: int = 0  # tokens per UTC day

    @property
    def any(self) -> bool:
        return bool(self.rpm or self.tpm or self.tpd)


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: its public id, the tenants it may act for, its models ([] = all), limits."""

    id: str
    tenants: frozenset[str]
    models: frozenset[str] = frozenset()
    limits: KeyLimits = KeyLimits()
    name: str = ""

    def owns(self, tenant: str) -> bool:
        return ANY_TENANT in self.tenants or tenant in self.tenants

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models or ANY_TENANT in self.models


#: The caller when authentication is off: any tenant, any model, no limits, no id.
ANONYMOUS = ApiKey(id="", tenants=frozenset({ANY_TENANT}))


@dataclass(frozen=True)
class Caller:
    """Who a request is from, as the pipeline needs it: the key (ANONYMOUS with keys off) and the
    tenant it acts for."""

    key: ApiKey
    tenant: str

    @property
    def key_id(self) -> str:
        return self.key.id


@dataclass(frozen=True)
class ApiKeys:
    """Accepted keys by sha256 digest. `enabled` False (no keys, no keys file): authentication off."""

    by_digest: dict[str, ApiKey]
    enabled: bool = field(default=False)

    @classmethod
    def parse(cls, raw: str) -> ApiKeys:
        """`key1=acme|beta;key2=*` (a key may own several tenants; `*` owns all)."""
        keys: dict[str, ApiKey] = {}
        for item in raw.split(";"):
            item = item.strip()
            if not item:
                continue
            key, sep, tenants = item.partition("=")
            if not sep or not key.strip() or not tenants.strip():
                raise ValueError("expected key=tenant|tenant;key2=* (one entry per key)")
            if len(key.strip()) < 16:
                raise ValueError("API keys must be at least 16 characters")
            digest = _digest(key.strip())
            owned = frozenset(t.strip() for t in tenants.split("|") if t.strip())
            keys[digest] = ApiKey(id=f"env-{digest[:8]}", tenants=owned)
        return cls(keys, enabled=bool(keys))

    @classmethod
    def from_records(cls, records: list[keys_file.KeyRecord]) -> ApiKeys:
        keys = {
            r.sha256: ApiKey(
                id=r.id,
                tenants=frozenset({r.tenant}),
                models=frozenset(r.models),
                limits=KeyLimits(r.rpm, r.tpm, r.tpd),
                name=r.name,
            )
            for r in records
        }
        return cls(keys, enabled=True)  # a keys file turns authentication on, even with no key in it

    def merged(self, other: ApiKeys) -> ApiKeys:
        return ApiKeys({**self.by_digest, **other.by_digest}, self.enabled or other.enabled)

    @property
    def owners(self) -> dict[str, frozenset[str]]:
        return {d: k.tenants for d, k in self.by_digest.items()}

    def authorize(self, authorization: str | None, tenant: str) -> None:
        """Raises Unauthenticated without a known key, PermissionDenied for a tenant it does not own."""
        self.caller(authorization, tenant)

    def tenant_of(self, authorization: str | None, requested: str = "") -> str:
        """The tenant a request acts for: the one it names, else its key's only tenant, else
        "default"; authorized as `authorize` does."""
        return self.caller(authorization, requested).tenant

    def caller(self, authorization: str | None, requested: str = "") -> Caller:
        """The key and the tenant a request acts for (see `tenant_of`)."""
        key = self.key_of(authorization)
        owned = key.tenants
        only = next(iter(owned)) if len(owned) == 1 and ANY_TENANT not in owned else ""
        tenant = requested or only or "default"
        if not key.owns(tenant):
            raise PermissionDenied(f"this API key may not act for tenant {tenant!r}", reason="TENANT_NOT_OWNED")
        return Caller(key, tenant)

    def authenticate(self, authorization: str | None) -> frozenset[str]:
        """The tenants the caller's key owns; Unauthenticated without a known key (keys on)."""
        return self.key_of(authorization).tenants

    def key_of(self, authorization: str | None) -> ApiKey:
        """The caller's key; Unauthenticated without a known one (ANONYMOUS with keys off)."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("missing API key: send `authorization: Bearer <key>`", reason="API_KEY_MISSING")
        # A lookup by digest: the digest of a guess tells nothing of a stored key's bytes.
        key = self.by_digest.get(_digest(token.strip()))
        if key is None:
            raise Unauthenticated("unknown API key", reason="API_KEY_INVALID")
        return key


class KeyRing:
    """The keys in force: LLMESH_API_KEYS and the keys file, re-read when the file changes (its
    size, mtime or inode; `llmesh keys` replaces it atomically). Same methods as ApiKeys."""

    def __init__(self, env_keys: str = "", path: str = "", poll_seconds: float = 0.5) -> None:
        self.env = ApiKeys.parse(env_keys)
        self.path = Path(path) if path else None
        self.poll_seconds = poll_seconds
        self._stamp: tuple[int, int, int] | None = None
        self.keys = self.env
        if self.path is not None:
            self._stamp = self._stat()
            self.keys = self.env.merged(ApiKeys.from_records(keys_file.load(self.path)))  # errors: refuse to start
            KEYS_FILE_VALID.set(1)
        self._published()

    def _stat(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _published(self) -> None:
        KEYS_LOADED.labels("env").set(len(self.env.by_digest))
        KEYS_LOADED.labels("file").set(len(self.keys.by_digest) - len(self.env.by_digest))

    def reload_if_changed(self) -> bool:
        """Re-reads the file when it changed; True when the keys in force changed."""
        if self.path is None:
            return False
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            records = keys_file.load(self.path)
        except keys_file.KeysFileError as exc:
            KEYS_RELOADS.labels("error").inc()
            KEYS_FILE_VALID.set(0)
            log.error("API keys file not reloaded, the previous keys stay in force: %s", exc)
            return False
        self.keys = self.env.merged(ApiKeys.from_records(records))
        KEYS_RELOADS.labels("ok").inc()
        KEYS_FILE_VALID.set(1)
        self._published()
        log.info(
            "API keys reloaded",
            extra={"fields": {"event": "api_keys_reloaded", "keys": len(records), "path": str(self.path)}},
        )
        return True

    async def watch(self) -> None:
        """Polls the file until cancelled (a stat per interval: nothing to wake on in containers'
        mounted secrets, where inotify misses the atomic symlink swap)."""
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                self.reload_if_changed()
            except Exception:  # never let the watcher die: keys would freeze silently
                log.exception("API keys file watch failed")

    @property
    def enabled(self) -> bool:
        return self.keys.enabled

    def tenants(self) -> set[str]:
        """Tenants named by some key (their usage gets its own label)."""
        return {t for k in self.keys.by_digest.values() for t in k.tenants if t != ANY_TENANT}

    def authorize(self, authorization: str | None, tenant: str) -> None:
        self.keys.authorize(authorization, tenant)

    def tenant_of(self, authorization: str | None, requested: str = "") -> str:
        return self.keys.tenant_of(authorization, requested)

    def caller(self, authorization: str | None, requested: str = "") -> Caller:
        return self.keys.caller(authorization, requested)

    def authenticate(self, authorization: str | None) -> frozenset[str]:
        return self.keys.authenticate(authorization)

    def key_of(self, authorization: str | None) -> ApiKey:
        return self.keys.key_of(authorization)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
