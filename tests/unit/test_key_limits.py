"""Per-key limits: exact windows on a fake clock, the daily budget's message, cluster-wide counts
through the run's real Redis (several limiters as several gateways), the local share while
Redis is away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from llmesh.errors import status_details, unpack_details
from llmesh.testing import FakeClock
from services.gateway.auth import KeyLimits
from services.gateway.limits import REASON_RPM, REASON_TPD, REASON_TPM, KeyLimiter, KeyLimitExceeded

DAY = 86_400
MIDNIGHT = 20_000 * DAY  # a UTC midnight


async def refused(limiter: KeyLimiter, key: str, limits: KeyLimits) -> KeyLimitExceeded:
    with pytest.raises(KeyLimitExceeded) as info:
        await limiter.admit(key, limits)
    return info.value


async def test_requests_per_minute_slide_and_keys_are_their_own() -> None:
    clock = FakeClock(MIDNIGHT + 100.0)
    limiter = KeyLimiter(clock=clock)
    limits = KeyLimits(rpm=3)
    await limiter.admit("a", limits)  # t=100
    clock.advance(10)
    await limiter.admit("a", limits)  # t=110
    await limiter.admit("a", limits)
    err = await refused(limiter, "a", limits)
    assert err.reason == REASON_RPM and err.limit == "rpm"
    assert err.retry_after == pytest.approx(50.0)  # the first leaves at t=160
    assert "3 requests per minute" in err.message and err.metadata["key_id"] == "a"
    await limiter.admit("b", limits)  # another key: its own window
    clock.advance(50)
    await limiter.admit("a", limits)  # t=160: one slot free again
    with pytest.raises(KeyLimitExceeded):
        await limiter.admit("a", limits)
    await limiter.admit("a", KeyLimits())  # no limits: never counted, never refused


async def test_tokens_per_minute_count_when_a_response_ends() -> None:
    clock = FakeClock(MIDNIGHT + 5.0)
    limiter = KeyLimiter(clock=clock)
    limits = KeyLimits(tpm=100)
    await limiter.admit("a", limits)
    limiter.record("a", limits, 60)
    await limiter.admit("a", limits)  # 60 < 100: admitted
    limiter.record("a", limits, 50)
    clock.advance(30)
    err = await refused(limiter, "a", limits)
    assert err.reason == REASON_TPM and err.metadata["used"] == "110"
    assert err.retry_after == pytest.approx(30.0)  # both records are from t=5: they leave at t=65
    clock.advance(30)
    await limiter.admit("a", limits)


async def test_the_daily_budget_says_so_and_resets_at_utc_midnight() -> None:
    clock = FakeClock(MIDNIGHT + DAY - 3 * 3600 - 60)  # 20:59 UTC
    limiter = KeyLimiter(clock=clock)
    limits = KeyLimits(tpd=1000)
    await limiter.admit("a", limits)
    limiter.record("a", limits, 1000)
    err = await refused(limiter, "a", limits)
    assert err.reason == REASON_TPD
    assert err.message == (
        "API key a has used its daily budget of 1000 tokens (1000 today); it resets at 00:00 UTC, in 3h01m"
    )
    assert err.retry_after == pytest.approx(3 * 3600 + 60)
    info = unpack_details(status_details(err.trailing_metadata()))
    assert info["error_info"].reason == REASON_TPD  # type: ignore[attr-defined]
    assert info["retry_info"].retry_delay.seconds == 3 * 3600 + 60  # type: ignore[attr-defined]
    clock.advance(3 * 3600 + 61)  # the next UTC day
    await limiter.admit("a", limits)


@pytest.fixture
async def rclients(redis_url: str) -> AsyncIterator[list[aioredis.Redis]]:
    made = [aioredis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2) for _ in range(3)]
    yield made
    for client in made:
        await client.aclose()


async def test_gateways_sharing_redis_share_each_keys_limit(rclients: list[aioredis.Redis]) -> None:
    # A generous Redis timeout: on a loaded runner the first calls (connections, script load) can
    # pass the default 0.25 s, and a gateway that times out falls back to its local share, which
    # is another test's subject; this one is about the exact count across gateways.
    gateways = [KeyLimiter(c, op_timeout=5.0) for c in rclients]
    limits = KeyLimits(rpm=10)

    async def one(i: int) -> bool:
        try:
            await gateways[i % 3].admit("shared", limits)
            return True
        except KeyLimitExceeded:
            return False

    admitted = await asyncio.gather(*(one(i) for i in range(30)))
    assert sum(admitted) == 10  # near a limit every request asks Redis: exact across gateways
    err = await refused(gateways[0], "shared", limits)
    assert 50 < err.retry_after <= 60
    await refused(gateways[1], "shared", limits)
    await gateways[2].admit("other", limits)


class _ReorderingRedis:
    """A Redis whose script counts each call as it arrives; while `hold` is set it keeps the
    replies until `answer_newest_first`, as replies on several connections may resume in any
    order: the oldest reading comes back last."""

    def __init__(self, hold: int) -> None:
        self.requests = 0
        self.hold = hold  # replies to keep back
        self.waiting: list[asyncio.Event] = []
        self.all_held = asyncio.Event()

    def register_script(self, _lua: str) -> object:
        async def script(keys: list[str], args: list[int], client: object = None) -> list[int]:
            self.requests += int(args[1])
            take, rpm = args[0] == 1, int(args[3])
            code = 1 if take and self.requests + 1 > rpm else 0
            if take and not code:
                self.requests += 1
            seen = self.requests
            if len(self.waiting) < self.hold:
                answered = asyncio.Event()
                self.waiting.append(answered)
                if len(self.waiting) == self.hold:
                    self.all_held.set()
                await answered.wait()
            return [code, 60_000 if code else 0, seen, 0, 0]

        return script

    def answer_newest_first(self) -> None:
        for event in reversed(self.waiting):
            event.set()


async def test_a_late_reply_with_an_older_count_does_not_make_a_key_look_far() -> None:
    fake = _ReorderingRedis(hold=10)
    limiter = KeyLimiter(fake, clock=FakeClock(MIDNIGHT + 1.0))
    limits = KeyLimits(rpm=10)
    calls = [asyncio.ensure_future(limiter.admit("k", limits)) for _ in range(10)]
    await fake.all_held.wait()
    fake.answer_newest_first()  # the reply that read 1 request resumes last
    await asyncio.gather(*calls)
    view = limiter.keys["k"].view
    assert view is not None and view[1] == 10
    # Near the limit, so it asks Redis and is refused (the old code took the last reply's
    # reading of 1 request as the key's use and admitted an 11th locally).
    with pytest.raises(KeyLimitExceeded):
        await limiter.admit("k", limits)


async def test_far_from_its_limit_a_key_is_decided_locally_and_synced(rclients: list[aioredis.Redis]) -> None:
    a, b = KeyLimiter(rclients[0], op_timeout=5.0), KeyLimiter(rclients[1], op_timeout=5.0)
    limits = KeyLimits(rpm=1000, tpm=1_000_000)
    await a.admit("k", limits)  # the first asks Redis (nothing known yet)
    calls = 0
    script = a._script

    async def counting(*args: object, **kw: object) -> object:
        nonlocal calls
        calls += 1
        return await script(*args, **kw)

    a._script = counting
    for _ in range(99):
        await a.admit("k", limits)
        a.record("k", limits, 10)
    assert calls == 0  # far below the limit: no round trip per request
    await a.sync()
    await b.sync()
    await b.admit("k", limits)  # b reads the cluster's count on its first request
    assert b.keys["k"].view is not None and b.keys["k"].view[1] == 101
    assert b.keys["k"].view[2] == 990


async def test_while_redis_is_away_each_gateway_enforces_its_share() -> None:
    clock = FakeClock(MIDNIGHT + 1.0)
    gone = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    limiter = KeyLimiter(gone, replicas=2, clock=clock)
    limits = KeyLimits(rpm=4)
    await limiter.admit("a", limits)
    await limiter.admit("a", limits)
    err = await refused(limiter, "a", limits)  # 4 / 2 replicas
    assert err.limit == "rpm" and not limiter.redis_ok
    await gone.aclose()
