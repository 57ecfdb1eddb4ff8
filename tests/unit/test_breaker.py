from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.errors import Unavailable, status_details, unpack_details
from llmesh.testing import FakeClock
from services.gateway.breaker import (
    CONSECUTIVE_FAILURES,
    FAILURE_RATE,
    PROBE_PASSED,
    RESET,
    SLOW_CALL_RATE,
    TRIALS_PASSED,
    WAIT_ELAPSED,
    BreakerConfig,
    BreakerOpen,
    CircuitBreaker,
    State,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock: FakeClock, **kw: object) -> tuple[CircuitBreaker, list[tuple[State, State, str]]]:
    seen: list[tuple[State, State, str]] = []
    kw.setdefault("consecutive_failures", 0)  # these tests are about the rates; see the tests below
    breaker = CircuitBreaker(
        "inference",
        BreakerConfig(**kw),  # type: ignore[arg-type]
        clock=clock,
        on_transition=[lambda old, new, reason: seen.append((old, new, reason))],
    )
    return breaker, seen


def ok(b: CircuitBreaker, n: int = 1, duration: float = 0.01) -> None:
    for _ in range(n):
        assert b.allow()
        b.record_success(duration)


def fail(b: CircuitBreaker, n: int = 1, duration: float = 0.01) -> None:
    for _ in range(n):
        assert b.allow()
        b.record_failure(duration)


def trip(b: CircuitBreaker) -> None:
    fail(b, b.config.minimum_calls)
    assert b.state is State.OPEN


def test_minimum_calls_respected(clock: FakeClock) -> None:
    b, seen = make(clock)
    fail(b, 9)
    assert b.state is State.CLOSED
    assert b.metrics().failure_rate is None
    fail(b)
    assert b.state is State.OPEN
    assert seen == [(State.CLOSED, State.OPEN, FAILURE_RATE)]


def test_opens_at_failure_rate_edge_not_below(clock: FakeClock) -> None:
    b, _ = make(clock)
    ok(b, 6)
    fail(b, 4)  # 4/10 = 40%
    assert b.state is State.CLOSED
    fail(b)  # 5/11 = 45%
    assert b.state is State.CLOSED
    assert b.metrics().failure_rate == pytest.approx(5 / 11)
    fail(b)  # 6/12 = 50%
    assert b.state is State.OPEN


def test_window_is_count_based_and_slides(clock: FakeClock) -> None:
    b, _ = make(clock)
    ok(b, 30)  # only the last 20 are kept
    fail(b, 9)  # 9/20
    assert b.state is State.CLOSED
    assert b.metrics().calls == 20
    fail(b)  # 10/20
    assert b.state is State.OPEN


def test_slow_call_rate_opens(clock: FakeClock) -> None:
    b, seen = make(clock, slow_call_duration=1.0)
    ok(b, 2, duration=0.999)
    ok(b, 7, duration=1.0)  # 9 calls: below minimum
    assert b.state is State.CLOSED
    ok(b, 1, duration=5.0)  # 8/10 slow = 80%
    assert b.state is State.OPEN
    assert seen[-1] == (State.CLOSED, State.OPEN, SLOW_CALL_RATE)


def test_slow_below_threshold_stays_closed(clock: FakeClock) -> None:
    b, _ = make(clock, slow_call_duration=1.0)
    ok(b, 3, duration=0.5)
    ok(b, 7, duration=2.0)  # 70% slow
    assert b.state is State.CLOSED
    assert b.metrics().slow_call_rate == pytest.approx(0.7)


def test_rejects_while_open_with_retry_after(clock: FakeClock) -> None:
    b, _ = make(clock)
    trip(b)
    clock.advance(2.0)
    assert not b.allow()
    with pytest.raises(BreakerOpen) as info:
        b.acquire()
    err = info.value
    assert isinstance(err, Unavailable)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.reason == "CIRCUIT_OPEN"
    assert err.retry_after == pytest.approx(3.0)
    assert err.metadata == {"downstream": "inference", "state": "open"}
    details = unpack_details(status_details(err.trailing_metadata()))
    assert details["retry_info"].retry_delay.seconds == 3  # type: ignore[attr-defined]
    assert details["error_info"].reason == "CIRCUIT_OPEN"  # type: ignore[attr-defined]
    assert b.metrics().not_permitted == 2
    # Outcomes reported while open change nothing.
    b.record_success(0.01)
    assert b.state is State.OPEN


def test_half_open_after_wait_with_limited_trials(clock: FakeClock) -> None:
    b, seen = make(clock)
    trip(b)
    clock.advance(4.999)
    assert b.state is State.OPEN
    clock.advance(0.001)
    assert b.state is State.HALF_OPEN
    assert seen[-1] == (State.OPEN, State.HALF_OPEN, WAIT_ELAPSED)
    permits = [b.acquire() for _ in range(3)]
    with pytest.raises(BreakerOpen) as info:
        b.acquire()
    assert info.value.state is State.HALF_OPEN
    assert info.value.retry_after == pytest.approx(5.0)
    assert not b.allow()
    for p in permits:
        p.success(0.01)
    assert b.state is State.CLOSED
    assert seen[-1] == (State.HALF_OPEN, State.CLOSED, TRIALS_PASSED)
    assert b.metrics().calls == 0  # fresh window
    fail(b, 9)
    assert b.state is State.CLOSED


def test_reopens_on_bad_trials(clock: FakeClock) -> None:
    b, seen = make(clock)
    trip(b)
    clock.advance(5.0)
    ok(b, 1)
    fail(b, 1)
    assert b.state is State.HALF_OPEN  # waits for all 3 trials
    fail(b, 1)  # 2/3 failed
    assert b.state is State.OPEN
    assert seen[-1] == (State.HALF_OPEN, State.OPEN, FAILURE_RATE)
    assert b.retry_after == pytest.approx(5.0)


def test_one_bad_trial_below_threshold_closes(clock: FakeClock) -> None:
    b, _ = make(clock)
    trip(b)
    clock.advance(5.0)
    ok(b, 2)
    fail(b, 1)  # 1/3 < 50%
    assert b.state is State.CLOSED


def test_slow_trials_reopen(clock: FakeClock) -> None:
    b, seen = make(clock, slow_call_duration=1.0)
    trip(b)
    clock.advance(5.0)
    ok(b, 3, duration=2.0)
    assert b.state is State.OPEN
    assert seen[-1] == (State.HALF_OPEN, State.OPEN, SLOW_CALL_RATE)


def test_transitions_counted_and_listener_errors_contained(clock: FakeClock) -> None:
    b, seen = make(clock)

    def broken(old: State, new: State, reason: str) -> None:
        raise RuntimeError("listener bug")

    b.on_transition.insert(0, broken)
    trip(b)
    clock.advance(5.0)
    ok(b, 3)
    trip(b)
    b.reset()
    assert [s[2] for s in seen] == [FAILURE_RATE, WAIT_ELAPSED, TRIALS_PASSED, FAILURE_RATE, RESET]
    assert b.transitions[(State.CLOSED, State.OPEN)] == 2
    assert b.transitions[(State.OPEN, State.HALF_OPEN)] == 1
    assert b.transitions[(State.HALF_OPEN, State.CLOSED)] == 1
    assert b.transitions[(State.OPEN, State.CLOSED)] == 1
    assert b.state is State.CLOSED


def test_stale_permit_does_not_decide_trials(clock: FakeClock) -> None:
    b, _ = make(clock)
    stale = b.acquire()  # granted while CLOSED
    trip(b)
    clock.advance(5.0)
    assert b.state is State.HALF_OPEN
    stale.failure(60.0)
    assert b.metrics().calls == 0
    ok(b, 3)
    assert b.state is State.CLOSED


async def test_guard_records_outcomes_and_durations(clock: FakeClock) -> None:
    class Invalid(Exception):
        pass

    b = CircuitBreaker(
        "tokenizer",
        BreakerConfig(minimum_calls=2, window_size=2, slow_call_duration=1.0),
        clock=clock,
        is_failure=lambda exc: not isinstance(exc, Invalid),
    )
    with pytest.raises(Invalid):
        async with b.guard():
            raise Invalid("bad request: the downstream is fine")
    async with b.guard():
        clock.advance(0.5)
    assert b.state is State.CLOSED
    m = b.metrics()
    assert (m.calls, m.failed, m.slow) == (2, 0, 0)
    async with b.guard():
        clock.advance(1.0)  # slow
    with pytest.raises(ConnectionError):
        async with b.guard():
            raise ConnectionError("down")
    assert b.state is State.OPEN  # 1/2 failed and 1/2 slow vs 50%
    with pytest.raises(BreakerOpen):
        async with b.guard():
            pytest.fail("must not run")


async def test_guard_cancellation_frees_trial_slot(clock: FakeClock) -> None:
    b, _ = make(clock, permitted_calls_in_half_open=1)
    trip(b)
    clock.advance(5.0)

    async def call() -> None:
        async with b.guard():
            await asyncio.Event().wait()  # in flight until cancelled

    task = asyncio.ensure_future(call())
    await asyncio.sleep(0)
    assert not b.allow()  # the only trial is in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.state is State.HALF_OPEN
    with b.guard():
        pass
    assert b.state is State.CLOSED


def test_permit_reports_once(clock: FakeClock) -> None:
    b, _ = make(clock, minimum_calls=2, window_size=2)
    p = b.acquire()
    clock.advance(0.2)
    p.failure()
    p.success()
    p.failure()
    assert b.metrics().calls == 1 and b.metrics().failed == 1


def test_a_failure_after_an_early_success_turns_it_into_a_failure(clock: FakeClock) -> None:
    # A stream reported slow when it stalled, then failed: one call, and a failed one.
    b, _ = make(clock, minimum_calls=2, window_size=4, consecutive_failures=0)
    p = b.acquire()
    p.success(1.0)
    assert b.metrics().failed == 0
    p.failure()
    p.failure()  # once only
    assert (b.metrics().calls, b.metrics().failed) == (1, 1)


@pytest.mark.parametrize(
    "kw",
    [
        {"window_size": 0},
        {"minimum_calls": 0},
        {"failure_rate_threshold": 0},
        {"slow_call_rate_threshold": 1.5},
        {"slow_call_duration": 0},
        {"wait_in_open": -1},
        {"permitted_calls_in_half_open": 0},
    ],
)
def test_config_validation(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(**kw)  # type: ignore[arg-type]


def test_minimum_calls_capped_at_window(clock: FakeClock) -> None:
    b, _ = make(clock, window_size=4, minimum_calls=10)
    fail(b, 4)
    assert b.state is State.OPEN


def test_permits_say_whether_they_are_half_open_trials(clock: FakeClock) -> None:
    b, _ = make(clock)
    assert not b.acquire().trial
    trip(b)
    clock.advance(5.0)
    trial = b.acquire()
    assert trial.trial
    trial.release()  # the caller's own deadline: no verdict, the slot is free again
    assert b.state is State.HALF_OPEN
    assert all(b.acquire().trial for _ in range(3))


def test_consecutive_failures_open_before_minimum_calls(clock: FakeClock) -> None:
    # A frozen service with few callers: each call waits out its budget; five in a row cut it off.
    b, seen = make(clock, consecutive_failures=5, minimum_calls=10)
    fail(b, 4)
    ok(b)
    fail(b, 4)
    assert b.state is State.CLOSED  # never five in a row
    fail(b)
    assert b.state is State.OPEN
    assert seen[-1] == (State.CLOSED, State.OPEN, CONSECUTIVE_FAILURES)


def test_consecutive_failures_zero_leaves_it_to_the_rates(clock: FakeClock) -> None:
    b, _ = make(clock, consecutive_failures=0, minimum_calls=10)
    fail(b, 9)
    assert b.state is State.CLOSED


def test_a_passing_probe_half_opens_before_the_wait(clock: FakeClock) -> None:
    b, seen = make(clock, wait_in_open=5.0)
    trip(b)
    clock.advance(0.3)
    assert b.probe_passed()
    assert b.state is State.HALF_OPEN
    assert seen[-1] == (State.OPEN, State.HALF_OPEN, PROBE_PASSED)
    ok(b, b.config.permitted_calls_in_half_open)
    assert b.state is State.CLOSED


def test_a_probe_does_not_cut_the_wait_after_failed_trials(clock: FakeClock) -> None:
    # Healthy to a health check, failing its calls: tried again only after the whole wait.
    b, _ = make(clock, wait_in_open=5.0)
    trip(b)
    assert b.probe_passed()
    fail(b, b.config.permitted_calls_in_half_open)
    assert b.state is State.OPEN
    assert not b.probe_passed()
    assert b.state is State.OPEN
    clock.advance(5.0)
    assert b.state is State.HALF_OPEN


def test_a_probe_changes_nothing_unless_open(clock: FakeClock) -> None:
    b, seen = make(clock)
    assert not b.probe_passed()
    assert b.state is State.CLOSED and not seen


def test_a_failed_probe_keeps_it_open_until_a_probe_passes(clock: FakeClock) -> None:
    # A frozen service: no trial calls are spent on it while probes get no answer, however long.
    b, _ = make(clock, wait_in_open=2.0)
    trip(b)
    for _ in range(20):
        clock.advance(0.5)
        b.probe_failed()
        assert b.state is State.OPEN
    assert b.probe_passed()  # it answers again
    assert b.state is State.HALF_OPEN


def test_without_probes_the_wait_still_ends(clock: FakeClock) -> None:
    b, _ = make(clock, wait_in_open=2.0)
    trip(b)
    clock.advance(1.0)
    b.probe_failed()
    clock.advance(2.0)
    assert b.state is State.HALF_OPEN
