"""Usage per tenant: a bounded tenant label set, what each outcome counts, the access line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from llmesh.errors import ResourceExhausted, Unavailable
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway.auth import ApiKey, Caller, KeyLimits
from services.gateway.limits import KeyLimiter, KeyLimitExceeded
from services.gateway.usage import OTHER_TENANTS, TenantLabels, UsageMeter


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"llmesh_gateway_tenant_{name}_total", labels) or 0.0


def test_tenants_past_the_cap_fold_into_one_label_but_keyed_tenants_never_do() -> None:
    labels = TenantLabels(2, known=lambda: {"keyed"})
    seen = [labels(t) for t in ("a", "b", "c", "a", "keyed", "d")]
    assert seen == ["a", "b", OTHER_TENANTS, "a", "keyed", OTHER_TENANTS]


def test_what_each_outcome_counts_and_the_access_line(caplog: pytest.LogCaptureFixture) -> None:
    meter = UsageMeter(KeyLimiter(), TenantLabels(100))
    key = ApiKey(id="k123", tenants=frozenset({"usage-unit"}), limits=KeyLimits(tpm=1000))
    caller = Caller(key, "usage-unit")
    t = {"tenant": "usage-unit", "model": "m"}
    names = (
        "requests",
        "input_tokens",
        "cached_input_tokens",
        "uncached_input_tokens",
        "output_tokens",
        "saved_tokens",
        "shed",
        "errors",
    )
    before = {n: sample(n, **t) for n in names}
    usage = common_pb2.Usage(input_tokens=30, output_tokens=7, prefix_cached_input_tokens=16)
    generated = gateway_pb2.GenerateResponse(usage=usage, model="m@x")
    cached = gateway_pb2.GenerateResponse(usage=common_pb2.Usage(cached_input_tokens=30, cached_output_tokens=7))
    caplog.set_level(logging.INFO, logger="llmesh.gateway")
    meter.finish(caller, "usage-unit", "m", "ok", "none", generated, None, 0.5)
    meter.finish(caller, "usage-unit", "m", "ok", "exact", cached, None, 0.001)
    shed = ResourceExhausted("x", retry_after=1)
    meter.finish(caller, "usage-unit", "m", "resource_exhausted", "none", None, shed, 0.0)
    limited = KeyLimitExceeded("k123", "tpd", 10, 12, 3600)
    meter.finish(caller, "usage-unit", "m", "resource_exhausted", "none", None, limited, 0.0)
    meter.finish(caller, "usage-unit", "m", "unavailable", "none", None, Unavailable("down"), 0.0)
    delta = {n: sample(n, **t) - v for n, v in before.items()}
    assert delta == {
        "requests": 5,
        "input_tokens": 30,
        # Of the prompt tokens processed, those the engine's prefix cache held and the rest apart.
        "cached_input_tokens": 16,
        "uncached_input_tokens": 14,
        "output_tokens": 7,
        "saved_tokens": 37,
        "shed": 1,
        "errors": 1,
    }
    assert sample("key_limited", **t, limit="tpd") >= 1  # a key's own limit is not a shed
    assert meter.limiter.keys["k123"].local.tokens  # the generated tokens count against its tpm
    lines = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event") == "generate"]  # type: ignore[attr-defined]
    assert len(lines) == 5
    assert lines[0] == {
        "event": "generate",
        "tenant": "usage-unit",
        "key_id": "k123",
        "model": "m",
        "outcome": "ok",
        "status": "OK",
        "cache_tier": "none",
        "duration_ms": 500.0,
        "input_tokens": 30,
        "cached_input_tokens": 16,
        "output_tokens": 7,
        "saved_tokens": 0,
        "degradations": [],
        "model_key": "m@x",
    }
    assert lines[3]["status"] == "RESOURCE_EXHAUSTED" and lines[3]["reason"] == "KEY_DAILY_BUDGET_EXHAUSTED"


def test_counters_off_leave_the_access_line_and_the_limits() -> None:
    meter = UsageMeter(KeyLimiter(), TenantLabels(100), counters=False)
    key = ApiKey(id="k9", tenants=frozenset({"usage-off"}), limits=KeyLimits(tpm=10))
    response = gateway_pb2.GenerateResponse(usage=common_pb2.Usage(input_tokens=5, output_tokens=5))
    meter.finish(Caller(key, "usage-off"), "usage-off", "m", "ok", "none", response, None, 0.1)
    assert sample("requests", tenant="usage-off", model="m") == 0
    assert sum(meter.limiter.keys["k9"].local.tokens.values()) == 10
