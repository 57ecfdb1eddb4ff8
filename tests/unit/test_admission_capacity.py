"""Admission that follows capacity: reservations refunded on finish, the weight in flight bounded
by a limit learned from measured throughput, and the Redis-shared window decided atomically per
request from several gateways at once (real Redis, database 6)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from llmesh.errors import ResourceExhausted
from services.gateway.admission import ADMIT_LUA, AdmissionConfig, CapacityLimit, RedisWeightWindow, WeightWindow


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def cfg(**kw: object) -> AdmissionConfig:
    base: dict[str, object] = {"budget": 100_000, "window_seconds": 10.0, "tenant_share": 1.0, "degrade": False}
    base.update(kw)
    return AdmissionConfig(**base)  # type: ignore[arg-type]


# --- reservation and refund ----------------------------------------------------------------------


def test_finish_refunds_what_was_not_generated() -> None:
    clock = Clock()
    w = WeightWindow(cfg(), clock=clock)
    a = w.plan("t", 10, 100)
    assert a.ticket is not None and w.occupancy() == 1000 and w.in_flight() == 1000
    a.ticket.progress(3)
    assert w.in_flight() == 970 and w.occupancy() == 1000  # reserved until the end
    assert a.ticket.finish() == 970
    assert w.occupancy() == 30 and w.occupancy("t") == 30 and w.in_flight() == 0
    assert a.ticket.finish() == 0  # once


def test_a_refund_after_the_entry_left_the_window_changes_nothing() -> None:
    clock = Clock()
    w = WeightWindow(cfg(), clock=clock)
    a = w.plan("t", 10, 100)
    b = w.plan("t", 10, 100)
    clock.t += 10.5  # a has left the window; b was admitted at the same instant, so it left too
    c = w.plan("t", 10, 10)
    assert a.ticket and b.ticket and c.ticket
    a.ticket.finish()
    assert w.occupancy() == 100
    c.ticket.finish()
    assert w.occupancy() == 0


def test_a_retry_after_a_failure_does_not_pay_twice() -> None:
    w = WeightWindow(cfg(budget=1000), clock=Clock())
    first = w.plan("t", 10, 100)
    assert first.ticket is not None
    first.ticket.finish()  # refused downstream: nothing generated
    assert w.plan("t", 10, 100).weight == 1000


# --- the learned in-flight limit --------------------------------------------------------------------


def test_a_cold_limit_is_conservative_and_opens_up_as_throughput_is_measured() -> None:
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=2.0, initial=1000, now=now.t)
    assert cap.limit() == 1000
    cap.requests = cap.streaming = 1
    for _ in range(10):  # 2,000 weight per second while busy
        now.t += 0.5
        cap.advance(now.t, 1000)
    assert cap.throughput == pytest.approx(2000)
    assert cap.limit() == pytest.approx(2000)  # Little: throughput x target x the half still in flight


def test_a_stalled_downstream_shrinks_the_limit_to_its_floor() -> None:
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=2.0, initial=1000, now=now.t)
    cap.requests = cap.streaming = 1
    for _ in range(4):
        now.t += 0.5
        cap.advance(now.t, 5000)
    high = cap.limit()
    for _ in range(40):  # busy, and nothing comes back
        now.t += 0.5
        cap.advance(now.t)
    assert high == pytest.approx(10_000)
    assert cap.limit() == 1000 / 16  # the floor: initial / 16


def test_at_the_limit_a_request_spends_the_target_in_the_system() -> None:
    # A batch of k requests, each 10 input tokens x 100 new tokens, one token per 10 ms step: a
    # request is in the system 1 s. Arrivals staggered evenly, so the tokens still to come are
    # spread over 0..100: the weight in flight is k x 10 x 50 (not k x 10 x 100).
    k, unit, tokens, step = 8, 10, 100, 0.01
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=tokens * step, initial=1, now=now.t)
    cap.requests = cap.streaming = k
    for _ in range(20):
        now.t += 0.5
        cap.advance(now.t, k * unit * 0.5 / step)
    in_flight = sum(unit * (tokens - i * tokens // k) for i in range(k))  # staggered: 100, 88, ... 13
    assert cap.limit() == pytest.approx(k * unit * tokens / 2)
    assert cap.limit() == pytest.approx(in_flight, rel=0.15)
    # A request joining such a batch waits about the target, not half of it.
    cap.in_flight = k * unit * tokens / 2
    assert cap.drain_seconds(unit * tokens) == pytest.approx(tokens * step * (1 + 1 / k))


def _period(cap: CapacityLimit, now: Clock, ttfts: list[float]) -> bool | None:
    """One judging period's first tokens, half a second apart; the verdict of the last one."""
    verdict = None
    for seconds in ttfts:
        now.t += 0.5
        verdict = cap.first_token(now.t, seconds)
    return verdict


def test_weight_carried_with_prompt_first_tokens_is_allowed_beyond_the_target() -> None:
    # A batching backend: 32 streams side by side, each slower than the target, none waiting.
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=3.0, initial=1000, now=now.t)
    cap.requests = cap.streaming = 1
    for _ in range(4):  # 2,000 weight/s: Little's law allows 3,000 in flight at a 3 s target
        now.t += 0.5
        cap.advance(now.t, 1000)
    assert cap.limit() == pytest.approx(3000)
    for _ in range(8):
        cap.admitted(1000)  # 8,000 in flight, more than Little's law would admit
    assert _period(cap, now, [0.20, 0.19, 0.21]) is False  # first tokens prompt: not queueing
    assert cap.carried == 8000
    assert cap.limit() == pytest.approx(8000 * 1.25)  # and it keeps probing upwards


def test_slow_first_tokens_take_the_carried_weight_back() -> None:
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=3.0, initial=1000, now=now.t)
    cap.admitted(8000)
    assert _period(cap, now, [0.2, 0.2, 0.2]) is False
    assert cap.carried == 8000
    cap.admitted(4000)  # the peak grows to 12,000 and first tokens wait: the backend queues
    assert _period(cap, now, [0.2, 0.9, 1.1]) is True  # median 0.9 s > 2 x 0.2 s + 50 ms
    assert cap.carried == 4000  # halved: queueing at 12,000 does not count what it carried
    assert cap.limit() == 5000  # below what is in flight: the queue drains
    cap.in_flight = cap._peak = 3000  # most of it finished; the backend still queues
    assert _period(cap, now, [1.0, 1.2, 1.3]) is True
    assert cap.carried == 1500  # half of at most the period's peak
    assert _period(cap, now, [1.0, 1.2, 1.3]) is True
    assert cap.carried == 750
    assert cap.limit() == 1000  # Little's law (cold here: `initial`) takes over
    assert _period(cap, now, [0.2, 0.2, 0.2]) is False  # prompt again: what it carried counts
    assert cap.carried == 3000


def test_first_tokens_a_few_steps_long_are_not_queueing_however_long_the_steps() -> None:
    # vLLM's CPU build: one stream steps in 25 ms, 32 in 95 ms; a first token waits a step or
    # three either way, so it takes 3x longer at 32 streams than at one without any queue.
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=3.0, initial=1000, now=now.t)
    cap.admitted(1000)
    assert _period(cap, now, [0.06, 0.07, 0.08]) is False
    cap.admitted(20_000)
    for _ in range(30):
        cap.between_tokens(0.095)
    assert _period(cap, now, [0.2, 0.28, 0.3]) is False  # > 2 x 0.07 + 50 ms, but 3 steps
    assert cap.carried == 21_000
    for _ in range(30):
        cap.between_tokens(0.095)
    assert _period(cap, now, [2.5, 3.0, 4.0]) is True  # 30 steps: waiting for whole answers


def test_the_window_measures_time_between_tokens_per_stream() -> None:
    clock = Clock(0.0)
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=1e6), clock=clock)
    a = w.plan("t", 10, 100)
    assert a.ticket is not None
    clock.t += 0.5
    a.ticket.progress(1)  # the first token: no gap yet
    clock.t += 0.3
    a.ticket.progress(3)  # three tokens 0.3 s later: 0.1 s each
    assert w.capacity()._itls == [pytest.approx(0.1)]


def test_a_judging_period_needs_time_and_samples() -> None:
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=3.0, initial=1000, now=now.t)
    cap.admitted(5000)
    assert cap.first_token(0.5, 0.2) is None  # too early
    assert cap.first_token(1.2, 0.2) is None  # a second in, but only two first tokens
    assert cap.first_token(1.3, 0.2) is False
    assert cap.first_token(2.0, 5.0) is None
    assert cap.first_token(6.4, 5.0) is True  # after JUDGE_MAX_S one sample is enough


def test_the_baseline_is_the_lowest_median_of_recent_periods() -> None:
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=3.0, initial=1000, now=now.t)
    assert _period(cap, now, [0.02, 0.1, 0.3]) is False  # spread over steps: the median counts
    assert cap.baseline() == pytest.approx(0.1)
    assert _period(cap, now, [0.02, 0.25, 0.3]) is False  # 0.25 = 2 x 0.1 + 0.05
    assert _period(cap, now, [0.02, 0.3, 0.35]) is True  # 0.3 > 2 x 0.1 + 0.05: queued
    now.t += 200.0  # the 0.1 s periods are forgotten: the backend's floor moved (longer prompts)
    assert _period(cap, now, [0.2, 0.3, 0.35]) is False
    assert cap.baseline() == pytest.approx(0.3)


def test_the_window_learns_first_tokens_from_tickets() -> None:
    clock = Clock(0.0)
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=1000), clock=clock)
    tickets = []
    for _ in range(3):
        a = w.plan("t", 10, 30)  # 300 each: 900 in flight
        assert a.ticket is not None
        tickets.append(a.ticket)
    clock.t += 1.0
    for ticket in tickets:
        ticket.progress(1)  # first tokens, 1 s after admission
    cap = w.capacity()
    assert cap.carried == 900 and cap.baseline() == pytest.approx(1.0)


def test_idle_time_does_not_dilute_the_measured_throughput() -> None:
    now = Clock(0.0)
    cap = CapacityLimit(cap=1e9, adaptive=True, target_seconds=1.0, initial=1000, now=now.t)
    cap.requests = cap.streaming = 1
    now.t += 1.0
    cap.advance(now.t, 3000)
    cap.requests = cap.streaming = 0
    now.t += 60.0  # idle
    cap.advance(now.t)
    assert cap.throughput == pytest.approx(3000)


def test_the_window_bounds_weight_in_flight_and_one_request_always_runs() -> None:
    clock = Clock()
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=1000), clock=clock)
    huge = w.plan("t", 10, 500)  # over the limit, but nothing is in flight: it runs
    assert huge.ticket is not None
    with pytest.raises(ResourceExhausted) as shed:
        w.plan("t", 10, 10)
    assert shed.value.reason == "IN_FLIGHT_LIMIT" and shed.value.retry_after > 0
    huge.ticket.finish()
    assert w.plan("t", 10, 100).weight == 1000


def test_not_adaptive_means_the_budget_is_the_only_limit() -> None:
    w = WeightWindow(cfg(budget=5000, adaptive=False, initial_in_flight=10), clock=Clock())
    for _ in range(5):
        w.plan("t", 10, 100)
    with pytest.raises(ResourceExhausted) as shed:
        w.plan("t", 10, 100)
    assert shed.value.reason == "WEIGHT_BUDGET_EXCEEDED"


def test_limits_are_learned_per_model() -> None:
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=1000), clock=Clock())
    w.plan("t", 10, 100, model="a")
    assert w.plan("t", 10, 100, model="b").weight == 1000  # model a's flight is its own
    with pytest.raises(ResourceExhausted):
        w.plan("t", 10, 100, model="a")


# --- the Redis-shared window --------------------------------------------------------------------------


@pytest_asyncio.fixture
async def clients(redis_url: str) -> AsyncIterator[list[aioredis.Redis]]:
    made = [aioredis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1) for _ in range(4)]
    yield made
    for c in made:
        await c.aclose()


@pytest_asyncio.fixture
async def prefix(clients: list[aioredis.Redis]) -> AsyncIterator[str]:
    name = f"test-capacity-{uuid.uuid4().hex}"
    yield name
    keys = [k async for k in clients[0].scan_iter(match="{" + name + "}*")]
    if keys:
        await clients[0].delete(*keys)


async def test_several_gateways_at_once_never_admit_past_the_shared_budget(
    clients: list[aioredis.Redis], prefix: str
) -> None:
    # A generous op_timeout: this test is about concurrency, not about Redis being slow.
    gateways = [RedisWeightWindow(cfg(budget=2000), c, prefix=prefix, op_timeout=5.0) for c in clients]

    async def one(i: int) -> int:
        try:
            return (await gateways[i % 4].plan("t", 10, 10)).weight
        except ResourceExhausted:
            return 0

    admitted = await asyncio.gather(*(one(i) for i in range(60)))
    assert sum(admitted) == 2000 and admitted.count(100) == 20
    assert await gateways[0].occupancy() == 2000


async def test_refunds_reach_the_shared_window(clients: list[aioredis.Redis], prefix: str) -> None:
    a = RedisWeightWindow(cfg(budget=2000), clients[0], prefix=prefix)
    b = RedisWeightWindow(cfg(budget=2000), clients[1], prefix=prefix)
    first = await a.plan("t", 10, 100)
    assert first.ticket is not None and await b.occupancy() == 1000
    first.ticket.progress(4)
    first.ticket.finish()
    await a.settle()
    assert await b.occupancy() == 40
    assert await b.occupancy("t") == 40


async def test_the_hold_is_released_only_after_the_redis_decision(clients: list[aioredis.Redis], prefix: str) -> None:
    w = RedisWeightWindow(cfg(budget=2000), clients[0], prefix=prefix)
    holds = [w.precheck("t", 10, 100, hold=True) for _ in range(2)]  # the budget, reserved
    deciding = asyncio.create_task(w.plan("t", 10, 100, hold=holds[0]))
    await asyncio.sleep(0)  # one loop step: the plan is now waiting on Redis
    assert not deciding.done()
    with pytest.raises(ResourceExhausted):  # the first request's weight still counts
        w.precheck("t", 10, 100, hold=True)
    assert (await deciding).weight == 1000
    assert w.fallback.held() == 1000  # only the second request's hold is left


async def test_a_timed_out_script_call_is_reconciled_not_admitted_twice(
    clients: list[aioredis.Redis], prefix: str
) -> None:
    w = RedisWeightWindow(cfg(budget=2000), clients[0], prefix=prefix, retry_interval=0.0)
    observer = RedisWeightWindow(cfg(budget=2000), clients[1], prefix=prefix)
    script = clients[0].register_script(ADMIT_LUA)
    replies = {"lost": 1}

    async def reply_lost(**kw: object) -> object:
        # The script runs in Redis; its reply is lost to our timeout (a slow event loop).
        result = await script(**kw)  # type: ignore[arg-type]
        if replies["lost"]:
            replies["lost"] -= 1
            raise TimeoutError
        return result

    w._scripts[ADMIT_LUA] = reply_lost
    timed_out = await w.plan("t", 10, 100)
    assert timed_out.source == "local_fallback"  # decided here, though Redis recorded it too
    served = await w.plan("t", 10, 50)
    assert served.source == "redis"
    await w.settle()
    assert w.reconciled == 1
    # Only what Redis itself decided is in Redis: the timed-out call's record is gone.
    assert await observer.occupancy() == 500
    assert w.fallback.occupancy() == 1500  # this replica counts both, once each


async def test_the_local_fallback_enforces_this_replicas_share() -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    w = RedisWeightWindow(cfg(budget=4000), dead, replicas=4, retry_interval=60)
    assert (await w.plan("t", 10, 100)).source == "local_fallback"
    with pytest.raises(ResourceExhausted):
        await w.plan("t", 10, 100)  # a quarter of the budget is this replica's while Redis is down
    await dead.aclose()


def test_a_long_prefill_does_not_dilute_the_measured_throughput() -> None:
    clock = Clock(0.0)
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=1e6), clock=clock)
    a = w.plan("t", 100, 100)
    assert a.ticket is not None
    clock.t += 10.0  # queued and prefilling: no tokens yet, and not a stall
    for _ in range(5):
        clock.t += 0.125
        a.ticket.progress(1)  # 100 weight every 0.125 s once streaming
    # The first tokens' weight arrives with no streaming time before it: 500 weight in 0.5 s.
    assert w.capacity().throughput == pytest.approx(1000)


def test_a_request_that_passed_the_precheck_keeps_its_room_when_the_limit_shrinks() -> None:
    # It held its predicted weight through its hops; the measured throughput fell meanwhile. It is
    # admitted with what it held (capped), not refused after the hops it already paid for.
    clock = Clock()
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=4000, degrade=True), clock=clock)
    running = w.plan("t", 10, 100)  # 1,000 in flight
    hold = w.precheck("t", 10, 100, hold=True)
    assert hold is not None and hold.weight == 1000
    w.capacity("").throughput = 100.0  # limit now max(initial / 4, 100 x 3 / 2) = 1,000: full
    with pytest.raises(ResourceExhausted):
        w.precheck("t", 10, 100)  # a newcomer is shed
    admitted = w.plan("t", 12, 100, hold=hold)  # its true size is a bit more than predicted
    assert admitted.ticket is not None and admitted.weight <= 1000 and admitted.max_new_tokens == 83
    assert admitted.degraded
    admitted.ticket.finish()
    assert running.ticket is not None
    running.ticket.finish()


def test_a_request_that_held_its_least_weight_is_admitted_when_its_prompt_came_out_longer() -> None:
    # The precheck capped it to its least new tokens at the predicted size; the exact prompt is a
    # little longer. It runs with its least new tokens rather than being refused after its hops.
    clock = Clock()
    w = WeightWindow(cfg(adaptive=True, initial_in_flight=4000, degrade=True, min_new_tokens=16), clock=clock)
    running = w.plan("t", 10, 300)  # 3,000 of 4,000 in flight
    hold = w.precheck("t", 50, 100, hold=True)  # 1,000 left: 20 new tokens at 50 input tokens
    assert hold is not None and hold.weight == 1000
    admitted = w.plan("t", 70, 100, hold=hold)  # 70 x 16 = 1,120: a little over what it held
    assert admitted.max_new_tokens == 16 and admitted.weight == 1120
    assert admitted.ticket is not None and running.ticket is not None
    admitted.ticket.finish()
    again = w.precheck("t", 50, 100, hold=True)
    assert again is not None and again.weight == 1000
    with pytest.raises(ResourceExhausted):
        w.plan("t", 500, 100, hold=again)  # 10x the prediction: refused
    running.ticket.finish()
