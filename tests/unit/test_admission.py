from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from llmesh.errors import RETRY_PUSHBACK_KEY, ResourceExhausted, status_details, unpack_details
from llmesh.settings import load
from llmesh.testing import FakeClock
from services.gateway.admission import (
    ADMIT_LUA,
    BATCH,
    REASON_BUDGET,
    REASON_TENANT,
    REASON_TOO_HEAVY,
    AdmissionConfig,
    RedisWeightWindow,
    RequestTooHeavy,
    WeightWindow,
    parse_budget,
    parse_lane_shares,
    parse_share,
    parse_tenant_budgets,
    request_weight,
)


def window(clock: FakeClock, budget: float = 100, **kw: object) -> WeightWindow:
    kw.setdefault("tenant_share", 1.0)
    return WeightWindow(AdmissionConfig(budget=budget, **kw), clock=clock)  # type: ignore[arg-type]


def refused(call: object, *args: object, **kw: object) -> ResourceExhausted:
    with pytest.raises(ResourceExhausted) as info:
        call(*args, **kw)  # type: ignore[operator]
    assert not isinstance(info.value, RequestTooHeavy)
    return info.value


def test_request_weight() -> None:
    assert request_weight(300, 128) == 38_400
    assert request_weight(0, 0) == 1


def test_admits_exactly_the_budget_then_refuses() -> None:
    clock = FakeClock()
    w = window(clock)
    a = w.admit("t", 60)
    assert (a.admitted, a.weight, a.occupancy, a.budget, a.source) == (True, 60, 60, 100, "local")
    assert w.admit("t", 40).occupancy == 100
    err = refused(w.admit, "t", 1)
    assert err.reason == REASON_BUDGET
    assert err.retry_after == pytest.approx(10.0)
    assert err.metadata["weight"] == "1"
    assert err.metadata["occupancy"] == "100"
    assert err.metadata["budget"] == "100"
    assert w.occupancy() == 100


def test_retry_after_is_when_enough_weight_leaves() -> None:
    clock = FakeClock()
    w = window(clock)
    w.admit("t", 30)  # t=0
    clock.advance(2)
    w.admit("t", 30)  # t=2
    clock.advance(2)
    w.admit("t", 40)  # t=4
    clock.advance(1)  # t=5
    assert refused(w.admit, "t", 20).retry_after == pytest.approx(5.0)  # first 30 leaves at 10
    assert refused(w.admit, "t", 31).retry_after == pytest.approx(7.0)  # needs both 30s: t=12
    err = refused(w.admit, "t", 100)
    assert err.retry_after == pytest.approx(9.0)  # everything gone at 14
    pushback = dict(err.trailing_metadata())[RETRY_PUSHBACK_KEY]
    assert pushback == "9000"
    info = unpack_details(status_details(err.trailing_metadata()))
    assert info["retry_info"].retry_delay.seconds == 9  # type: ignore[attr-defined]
    # The window slides: room is back exactly when the entries leave.
    clock.now = 1000.0 + 9.999
    refused(w.admit, "t", 20)
    clock.now = 1000.0 + 10
    assert w.admit("t", 30).occupancy == 100
    clock.now = 1000.0 + 14
    assert w.occupancy() == 30


def test_tenant_share_prevents_starvation() -> None:
    clock = FakeClock()
    w = window(clock, tenant_share=0.5, tenant_budgets={"acme": 80})
    w.admit("noisy", 50)
    err = refused(w.admit, "noisy", 1)
    assert err.reason == REASON_TENANT
    assert err.metadata["budget"] == "50"
    assert err.metadata["scope"] == "tenant"
    assert w.admit("quiet", 50).tenant_occupancy == 50
    assert w.occupancy("noisy") == 50
    assert w.occupancy("nobody") == 0
    # Both full now: the global budget is the binding one for a third tenant.
    assert refused(w.admit, "third", 1).reason == REASON_BUDGET
    clock.advance(10)
    a = w.admit("acme", 80)  # explicit override above the share
    assert a.tenant_budget == 80
    assert refused(w.admit, "acme", 1).reason == REASON_TENANT


def test_batch_lane_limited_while_interactive_fits() -> None:
    clock = FakeClock()
    w = window(clock)
    w.admit("t", 50, BATCH)
    err = refused(w.admit, "t", 1, BATCH)
    assert err.reason == REASON_BUDGET
    assert err.metadata["budget"] == "50"
    assert err.metadata["lane"] == "batch"
    assert w.admit("t", 50).occupancy == 100  # interactive keeps its headroom
    clock.advance(10)
    w.admit("t", 45)  # interactive load also pushes batch out
    w.admit("t", 5, BATCH)
    refused(w.admit, "t", 1, BATCH)
    with pytest.raises(ValueError, match="unknown lane"):
        w.admit("t", 1, "bulk")


def test_plan_degrades_max_new_tokens() -> None:
    clock = FakeClock()
    w = window(clock, budget=1000)
    full = w.plan("t", 10, 30)
    assert (full.max_new_tokens, full.degraded, full.weight) == (30, False, 300)
    clock.advance(1)
    w.admit("t", 500)  # occupancy 800
    capped = w.plan("t", 10, 100)
    assert (capped.max_new_tokens, capped.degraded, capped.weight, capped.occupancy) == (20, True, 200, 1000)
    clock.advance(1)
    err = refused(w.plan, "t", 10, 100)  # no room; the floor (16 tokens) would need 160
    assert err.metadata["weight"] == "160"
    assert err.retry_after == pytest.approx(8.0)  # the 300 from t=0 leaves at t=10
    clock.advance(8)  # the first 300 left
    err = refused(w.plan, "t", 10, 100, allow_degrade=False)
    assert err.metadata["weight"] == "1000"
    assert w.plan("t", 10, 100).max_new_tokens == 30
    short = WeightWindow(AdmissionConfig(budget=1000, tenant_share=1, degrade=False), clock=clock)
    short.admit("t", 800)
    refused(short.plan, "t", 10, 30)  # degrade off by config
    assert short.plan("t", 10, 30, allow_degrade=True).max_new_tokens == 20


def test_degrade_does_not_go_below_floor() -> None:
    clock = FakeClock()
    w = window(clock, budget=1000)
    w.admit("t", 850)  # room 150 < 10 * 16
    refused(w.plan, "t", 10, 100)
    assert w.plan("t", 10, 15).max_new_tokens == 15  # asked below the floor: fits as is


def test_too_heavy_request() -> None:
    clock = FakeClock()
    w = window(clock, budget=1000, tenant_share=0.5)
    assert w.fits_ever(500) and not w.fits_ever(501)
    assert w.fits_ever(1000, tenant=None, lane="interactive") is False
    assert not w.fits_ever(501, lane=BATCH) and w.fits_ever(500, lane=BATCH)
    with pytest.raises(RequestTooHeavy) as info:
        w.admit("t", 501)
    err = info.value
    assert isinstance(err, ResourceExhausted)
    assert err.reason == REASON_TOO_HEAVY
    assert err.metadata["max_weight"] == "500"
    assert RETRY_PUSHBACK_KEY not in dict(err.trailing_metadata())
    assert "retry_info" not in unpack_details(status_details(err.trailing_metadata()))
    with pytest.raises(RequestTooHeavy) as info:
        w.plan("t", 40, 100)  # even 16 tokens: 640 > 500
    assert info.value.metadata["max_new_tokens_limit"] == "12"
    degraded = w.plan("t", 10, 500)  # 5000 never fits, but the cap makes it fit
    assert (degraded.max_new_tokens, degraded.degraded) == (50, True)
    assert w.occupancy() == 500


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("acme", "must look like name=value"),
        ("=5", "empty name"),
        ("acme=5,acme=6", "listed twice"),
        ("acme=x", "must be a number"),
        ("acme=-1", "finite number > 0"),
        ("acme=inf", "finite number > 0"),
        ("ac me=1", "may only hold"),
    ],
)
def test_tenant_budget_parser_errors(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tenant_budgets(raw)


def test_parsers() -> None:
    assert parse_tenant_budgets("acme=5e6, beta=1e6 ,") == {"acme": 5e6, "beta": 1e6}
    assert parse_tenant_budgets("") == {}
    assert parse_lane_shares("interactive=1,batch=0.5") == {"interactive": 1.0, "batch": 0.5}
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        parse_lane_shares("batch=1.5")
    with pytest.raises(ValueError, match="at least one lane"):
        parse_lane_shares(" ")
    assert parse_budget("2e7") == 2e7
    with pytest.raises(ValueError, match="budget"):
        parse_budget("0")
    assert parse_share("0.25") == 0.25
    with pytest.raises(ValueError, match="share"):
        parse_share("2")


def test_config_validation_and_from_settings() -> None:
    for bad in (
        {"budget": 0},
        {"budget": 1, "tenant_share": 0},
        {"budget": 1, "lanes": {"x": 2}},
        {"budget": 1, "lanes": {}},
        {"budget": 1, "min_new_tokens": 0},
        {"budget": 1, "window_seconds": 0},
        {"budget": 1, "tenant_budgets": {"a": -1}},
    ):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)  # type: ignore[arg-type]
    settings = load("gateway", {"LLMESH_ADMISSION_TENANT_BUDGETS": "acme=5e6"})
    config = AdmissionConfig.from_settings(settings.admission)
    assert config.tenant_limit("acme") == 5e6
    assert config.tenant_limit("other") == 1e7
    assert config.max_weight(None, BATCH) == 1e7


# --- Redis window (the run's real Redis, a database of the test's own) ------------------------------


@pytest.fixture
async def rclient(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(rclient: aioredis.Redis) -> AsyncIterator[str]:
    name = f"test:admission:{uuid.uuid4().hex}"
    yield name
    keys = [k async for k in rclient.scan_iter(match="{" + name + "}*")]
    if keys:
        await rclient.delete(*keys)


def cfg(budget: float = 100, **kw: object) -> AdmissionConfig:
    kw.setdefault("tenant_share", 1.0)
    return AdmissionConfig(budget=budget, **kw)  # type: ignore[arg-type]


async def refused_async(coro: object) -> ResourceExhausted:
    with pytest.raises(ResourceExhausted) as info:
        await coro  # type: ignore[misc]
    return info.value


async def test_redis_two_gateways_share_one_budget(rclient: aioredis.Redis, prefix: str) -> None:
    a = RedisWeightWindow(cfg(), rclient, prefix=prefix)  # Redis TIME
    b = RedisWeightWindow(cfg(), rclient, prefix=prefix)
    first = await a.admit("t", 60)
    assert (first.source, first.occupancy) == ("redis", 60)
    assert (await b.admit("u", 40)).occupancy == 100
    for gw in (a, b):
        err = await refused_async(gw.admit("v", 1))
        assert err.reason == REASON_BUDGET
        assert err.metadata["occupancy"] == "100"
        assert 9.0 < err.retry_after <= 10.0
    assert await a.occupancy() == 100
    assert await b.occupancy("u") == 40
    assert a.fallback.occupancy() == 60  # mirrored locally for a fallback
    assert 0 < await rclient.pttl("{" + prefix + "}:all") <= 21_000


async def test_redis_exact_retry_after_slide_tenants_degrade(rclient: aioredis.Redis, prefix: str) -> None:
    clock = FakeClock(1_700_000_000.0)
    config = cfg(tenant_share=0.5, tenant_budgets={"big": 100})
    a = RedisWeightWindow(config, rclient, prefix=prefix, clock=clock)
    b = RedisWeightWindow(config, rclient, prefix=prefix, clock=clock)
    await a.admit("big", 30)  # t=0
    clock.advance(2)
    await b.admit("big", 70)  # t=2
    clock.advance(3)  # t=5
    err = await refused_async(a.admit("big", 50))
    assert err.retry_after == pytest.approx(7.0)  # both entries must leave: t=12
    err = await refused_async(b.admit("big", 20))
    assert err.retry_after == pytest.approx(5.0)
    clock.advance(5)  # t=10: the 30 left
    assert (await b.admit("small", 30)).tenant_occupancy == 30
    err = await refused_async(a.admit("small", 21))
    assert (err.reason, err.metadata["budget"]) == (REASON_TENANT, "50")
    clock.advance(2)  # t=12: the 70 left too; occupancy 30 (small)
    plan = await a.plan("small", 2, 10)
    assert (plan.max_new_tokens, plan.degraded, plan.tenant_occupancy) == (10, False, 50)
    plan = await b.plan("other", 1, 100)  # room 50: capped to 50 tokens
    assert (plan.max_new_tokens, plan.degraded, plan.weight) == (50, True, 50)
    assert await a.occupancy() == 100


async def test_redis_degrade_and_batch(rclient: aioredis.Redis, prefix: str) -> None:
    clock = FakeClock(1_700_000_000.0)
    w = RedisWeightWindow(cfg(budget=1000), rclient, prefix=prefix, clock=clock)
    await w.admit("t", 400, BATCH)
    err = await refused_async(w.admit("t", 101, BATCH))
    assert err.metadata["budget"] == "500"
    await w.admit("t", 400)
    p = await w.plan("t", 10, 100)
    assert (p.max_new_tokens, p.degraded, p.occupancy) == (20, True, 1000)
    with pytest.raises(RequestTooHeavy):
        await w.admit("t", 1001)


async def test_redis_down_falls_back_to_local() -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    clock = FakeClock()
    failures: list[BaseException] = []
    w = RedisWeightWindow(cfg(), dead, clock=clock, on_fallback=failures.append, retry_interval=1.0)
    try:
        a = await w.admit("t", 60)
        assert a.source == "local_fallback"
        assert not w.redis_ok
        assert (await w.admit("t", 40)).occupancy == 100
        err = await refused_async(w.admit("t", 1))  # the local window still enforces the budget
        assert err.reason == REASON_BUDGET
        assert await w.occupancy() == 100
        assert len(failures) == 1 and w.fallbacks == 4
    finally:
        await dead.aclose()


async def test_redis_recovers_after_retry_interval(rclient: aioredis.Redis, prefix: str) -> None:
    clock = FakeClock(1_700_000_000.0)
    w = RedisWeightWindow(cfg(), rclient, prefix=prefix, clock=clock, retry_interval=1.0)
    real = rclient.register_script(ADMIT_LUA)
    calls = {"n": 0}

    async def flaky(**kw: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RedisConnectionError("boom")
        return await real(**kw)  # type: ignore[arg-type]

    w._scripts[ADMIT_LUA] = flaky
    assert (await w.admit("t", 10)).source == "local_fallback"
    assert (await w.admit("t", 10)).source == "local_fallback"  # not retried yet
    assert calls["n"] == 1
    clock.advance(1.0)
    assert (await w.admit("t", 10)).source == "redis"
    assert w.redis_ok


def test_precheck_refuses_like_plan_but_records_nothing() -> None:
    clock = FakeClock()
    w = window(clock, budget=100, degrade=False)
    w.precheck("t", 5, 10)  # 50 fits an empty window
    assert w.occupancy() == 0
    w.plan("t", 6, 10)  # 60 admitted for real
    err = refused(w.precheck, "t", 5, 10)  # a lower bound of 50 no longer fits
    assert err.reason == REASON_BUDGET and err.retry_after == pytest.approx(10.0)
    assert w.occupancy() == 60
    w.precheck("t", 4, 10)  # 40 still fits exactly
    assert w.occupancy() == 60


def test_held_prechecks_shed_a_burst_before_its_hops() -> None:
    clock = FakeClock()
    w = window(clock, budget=100, degrade=False)
    first = w.precheck("t", 4, 10, hold=True)  # 40 on its way to plan
    second = w.precheck("t", 4, 10, hold=True)  # 80
    assert first is not None and second is not None and w.held() == 80
    assert w.occupancy() == 0  # holds are not admissions
    err = refused(w.precheck, "t", 4, 10, hold=True)  # 80 held + 40 > 100: shed now
    assert err.reason == REASON_BUDGET
    assert err.retry_after == pytest.approx(10.0)  # held weight stays a whole window once admitted
    assert w.plan("t", 4, 10).weight == 40  # a precheck never refuses plan itself
    first.release()
    first.release()  # idempotent
    assert w.held() == 40 and w.held("t") == 40
    second.release()
    assert w.held() == 0 and w.held("t") == 0
    w.precheck("t", 6, 10)  # 40 admitted + 60 fits exactly once nothing is held


def test_holds_count_per_tenant_share() -> None:
    clock = FakeClock()
    w = window(clock, budget=100, degrade=False, tenant_share=0.5)
    held = w.precheck("a", 5, 10, hold=True)  # tenant a holds its whole 50
    err = refused(w.precheck, "a", 1, 10)
    assert err.reason == REASON_TENANT
    assert w.precheck("b", 5, 10) is None  # other tenants are not held back by a's holds
    assert held is not None
    held.release()
    w.precheck("a", 5, 10)


def test_a_hold_reserves_room_for_its_own_plan() -> None:
    clock = FakeClock()
    w = window(clock, budget=100, degrade=True, min_new_tokens=5)
    mine = w.precheck("t", 5, 10, hold=True)  # reserves its full predicted 50, not 5 x least
    other = w.precheck("t", 6, 10, hold=True)  # 60 does not fit beside 50: reserves 6 x 8 = 48
    assert mine is not None and other is not None
    assert (mine.weight, other.weight, w.held()) == (50, 48, 98)
    err = refused(w.precheck, "t", 1, 10, hold=True)  # 2 left < 1 x least 5: shed before its hops
    assert err.reason == REASON_BUDGET
    admitted = w.plan("t", 5, 10, hold=mine)
    assert (admitted.weight, admitted.degraded, w.held()) == (50, False, 48)
    # The other's true size outgrew its prediction (7 > 6 tokens): capping absorbs it, no late shed.
    late = w.plan("t", 7, 10, hold=other)
    assert (late.weight, late.max_new_tokens, late.degraded, w.held()) == (49, 7, True, 0)


def test_a_plan_with_a_hold_cannot_take_room_promised_to_others() -> None:
    clock = FakeClock()
    w = window(clock, budget=100, degrade=False)
    first = w.precheck("t", 4, 10, hold=True)
    second = w.precheck("t", 4, 10, hold=True)
    assert first is not None and second is not None
    # The first's true size is 7 tokens: 70 does not fit beside the 40 the second holds.
    err = refused(w.plan, "t", 7, 10, hold=first)
    assert err.reason == REASON_BUDGET and first.released
    assert w.plan("t", 4, 10, hold=second).weight == 40
