"""The SDK's retries of shed calls and its client-side adaptive throttling, on a fake clock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import grpc
import pytest

from llmesh.client import (
    REASON_CLIENT_THROTTLED,
    AdaptiveThrottle,
    CallGuard,
    InvalidRequestError,
    MeshError,
    OverloadedError,
    RetryPolicy,
)
from llmesh.testing import FakeClock


def shed(retry_after: float | None = 0.4) -> OverloadedError:
    return OverloadedError(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", retry_after=retry_after, reason="QUEUE")


def guard(clock: FakeClock, retries: int = 2, throttle: AdaptiveThrottle | None = None) -> CallGuard:
    return CallGuard(RetryPolicy(retries=retries), throttle, clock=clock, rng=random.Random(1))


def run(g: CallGuard, call: Callable[[float], str], timeout: float, sleep: Callable[[float], None]) -> str:
    """The guard's retry loop over a call that answers at once, sleeping on the fake clock."""

    async def once(left: float) -> str:
        return call(left)

    async def fake_sleep(seconds: float) -> None:
        sleep(seconds)

    return asyncio.run(g.run_async(once, timeout, fake_sleep))


def test_a_shed_is_retried_after_its_retry_info_with_jitter() -> None:
    clock = FakeClock()
    g = guard(clock)
    sleeps: list[float] = []
    answers: list[object] = [shed(0.4), shed(0.4), "ok"]

    def call(left: float) -> str:
        answer = answers.pop(0)
        if isinstance(answer, MeshError):
            raise answer
        return str(answer)

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)

    assert run(g, call, 10.0, sleep) == "ok"
    assert len(sleeps) == 2 and all(0.4 <= s < 0.6 for s in sleeps)
    assert sleeps[0] != sleeps[1]  # jittered: a crowd shed together does not come back together


def test_no_retry_past_the_deadline_nor_for_what_can_never_fit() -> None:
    clock = FakeClock()
    g = guard(clock, retries=5)
    calls = 0

    def too_slow(left: float) -> str:
        nonlocal calls
        calls += 1
        raise shed(3.0)

    with pytest.raises(OverloadedError):
        run(g, too_slow, 2.0, clock.advance)
    assert calls == 1  # 3 s of retry info does not fit in a 2 s timeout

    calls = 0

    def invalid(left: float) -> str:
        nonlocal calls
        calls += 1
        raise InvalidRequestError(grpc.StatusCode.INVALID_ARGUMENT, "bad")

    with pytest.raises(InvalidRequestError):
        run(g, invalid, 10.0, clock.advance)
    assert calls == 1
    with pytest.raises(OverloadedError):
        run(g, lambda left: (_ for _ in ()).throw(shed(None)), 10.0, clock.advance)  # too heavy: no retry info


def test_the_throttle_refuses_locally_when_most_calls_are_shed_and_recovers() -> None:
    clock = FakeClock()
    throttle = AdaptiveThrottle(k=2.0, window_s=120.0, clock=clock, rng=random.Random(3))
    for _ in range(10):
        assert throttle.allow()
        throttle.accepted()
    assert throttle.reject_probability() == 0.0  # everything accepted: nothing refused
    for _ in range(200):
        throttle.allow()  # shed by the mesh (or refused here): no accept
    p = throttle.reject_probability()
    assert 0.8 < p < 1.0  # (210 - 2 x 10) / 211
    refused = sum(not throttle.allow() for _ in range(1000))
    assert 800 < refused < 1000
    clock.advance(121)  # the shed past leaves the window
    assert throttle.reject_probability() == 0.0


def test_a_throttled_call_never_reaches_the_mesh() -> None:
    clock = FakeClock()
    throttle = AdaptiveThrottle(k=1.0, clock=clock, rng=random.Random(0))
    g = guard(clock, retries=0, throttle=throttle)
    sent = 0

    def call(left: float) -> str:
        nonlocal sent
        sent += 1
        raise shed()

    outcomes = []
    for _ in range(50):
        with pytest.raises(OverloadedError) as info:
            run(g, call, 10.0, clock.advance)
        outcomes.append(info.value.reason)
    assert outcomes.count(REASON_CLIENT_THROTTLED) > 25 and sent + outcomes.count(REASON_CLIENT_THROTTLED) == 50
