"""API keys at the gateway: who may act for which tenant, and which tenant a request acts for."""

from __future__ import annotations

import pytest

from llmesh.errors import PermissionDenied, Unauthenticated
from services.gateway.auth import ApiKeys

ALL, ACME, TWO = "key-for-all-tenants-0001", "key-for-acme-only-00001", "key-for-acme-and-beta-01"
KEYS = ApiKeys.parse(f"{ALL}=*;{ACME}=acme;{TWO}=acme|beta")


def test_tenant_comes_from_a_key_that_owns_one() -> None:
    assert KEYS.tenant_of(f"Bearer {ACME}") == "acme"
    assert KEYS.tenant_of(f"Bearer {ACME}", "acme") == "acme"
    assert KEYS.tenant_of(f"Bearer {ALL}") == "default"
    assert KEYS.tenant_of(f"bearer {ALL}", "beta") == "beta"
    assert KEYS.tenant_of(f"Bearer {TWO}", "beta") == "beta"
    assert ApiKeys.parse("").tenant_of(None, "x") == "x" and ApiKeys.parse("").tenant_of(None) == "default"


def test_missing_unknown_and_foreign_tenants_are_refused() -> None:
    with pytest.raises(Unauthenticated) as missing:
        KEYS.tenant_of(None)
    assert missing.value.reason == "API_KEY_MISSING"
    with pytest.raises(Unauthenticated) as unknown:
        KEYS.authenticate("Bearer not-a-key-at-all-000")
    assert unknown.value.reason == "API_KEY_INVALID"
    with pytest.raises(PermissionDenied):
        KEYS.tenant_of(f"Bearer {ACME}", "beta")
    with pytest.raises(PermissionDenied):  # owns two tenants, names none: "default" is not one of them
        KEYS.tenant_of(f"Bearer {TWO}")
    KEYS.authorize(f"Bearer {TWO}", "acme")
    with pytest.raises(PermissionDenied):
        KEYS.authorize(f"Bearer {TWO}", "gamma")
