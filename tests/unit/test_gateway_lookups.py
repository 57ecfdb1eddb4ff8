"""The gateway's lookup coalescing, on its own: which lookups go alone, which go together."""

from __future__ import annotations

import asyncio

import pytest

from llmesh.testing import eventually
from llmesh.v1 import cache_pb2
from services.gateway.deadline import CallerDeadline, Deadline
from services.gateway.lookups import LookupCoalescer


class Cache:
    """Answers each prompt with itself as the answer text, once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.singles: list[str] = []
        self.batches: list[list[str]] = []
        self.fail = False
        self.single_called = asyncio.Event()
        self.called = asyncio.Condition()  # notified on every call, single or batch

    async def calls_reach(self, n: int) -> None:
        """Until `n` calls (singles and batches) have come in."""
        async with self.called:
            await asyncio.wait_for(self.called.wait_for(lambda: len(self.singles) + len(self.batches) >= n), 5)

    async def _heard(self) -> None:
        async with self.called:
            self.called.notify_all()

    def answer(self, request: cache_pb2.CacheLookupRequest) -> cache_pb2.CacheLookupResponse:
        return cache_pb2.CacheLookupResponse(hit=True, answer=cache_pb2.CachedAnswer(text=request.prompt))

    async def lookup(self, request: cache_pb2.CacheLookupRequest, deadline: Deadline) -> cache_pb2.CacheLookupResponse:
        assert 0 < deadline.remaining() <= 5.0  # the caller's deadline (the hop budget is Peers')
        self.singles.append(request.prompt)
        self.single_called.set()
        await self._heard()
        await self.release.wait()
        if self.fail:
            raise RuntimeError("cache down")
        return self.answer(request)

    async def lookup_batch(
        self, request: cache_pb2.CacheLookupBatchRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupBatchResponse:
        self.batches.append([r.prompt for r in request.requests])
        await self._heard()
        await self.release.wait()
        if self.fail:
            raise RuntimeError("cache down")
        return cache_pb2.CacheLookupBatchResponse(results=[self.answer(r) for r in request.requests])


async def ask(coalescer: LookupCoalescer, prompt: str) -> str:
    reply = await coalescer.lookup(cache_pb2.CacheLookupRequest(prompt=prompt), Deadline.after(5))
    return reply.answer.text


async def test_lookups_of_one_loop_turn_go_together_while_calls_are_in_flight_they_queue() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=2, max_batch=3)
    cache.release.set()
    assert await ask(coalescer, "q") == "q"
    assert cache.singles == ["q"] and cache.batches == []  # one caller: a plain Lookup
    cache.release.clear()
    tasks = [asyncio.create_task(ask(coalescer, f"q{i}")) for i in range(7)]
    await cache.calls_reach(1 + 2)  # "q", then as many calls as may be in flight
    # The seven came in one loop turn: two calls of up to three went out, one lookup waits.
    assert cache.batches == [["q0", "q1", "q2"], ["q3", "q4", "q5"]] and cache.singles == ["q"]
    cache.release.set()
    answers = await asyncio.gather(*tasks)
    assert answers == [f"q{i}" for i in range(7)]  # every caller gets its own answer
    assert cache.singles == ["q", "q6"]  # sent alone by the first call to return
    assert coalescer.in_flight == 0


async def test_a_failed_batch_fails_each_of_its_callers_and_a_cancelled_caller_is_skipped() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=8)
    first = asyncio.create_task(ask(coalescer, "a"))
    await cache.single_called.wait()
    queued = [asyncio.create_task(ask(coalescer, p)) for p in ("b", "c", "d")]
    await eventually(lambda: len(coalescer._queue) == 3, 5.0, message="the three never queued")
    queued[1].cancel()  # "c" gives up while queued
    cache.fail = True
    cache.release.set()
    with pytest.raises(RuntimeError):
        await first
    for task in (queued[0], queued[2]):
        with pytest.raises(RuntimeError, match="cache down"):
            await task
    assert cache.batches == [["b", "d"]]
    assert coalescer.in_flight == 0


class DeadlineCache(Cache):
    """Like Cache, but a call runs only until its deadline, as `upstream.call_unary` does: then it fails
    with CallerDeadline. Batches wait for `batch_release`."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_release = asyncio.Event()

    async def lookup_batch(
        self, request: cache_pb2.CacheLookupBatchRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupBatchResponse:
        self.batches.append([r.prompt for r in request.requests])
        try:
            await asyncio.wait_for(self.batch_release.wait(), deadline.check("cache"))
        except TimeoutError:
            raise CallerDeadline("cache: the request's deadline ran out") from None
        return cache_pb2.CacheLookupBatchResponse(results=[self.answer(r) for r in request.requests])


async def ask_within(coalescer: LookupCoalescer, prompt: str, seconds: float) -> str:
    reply = await coalescer.lookup(cache_pb2.CacheLookupRequest(prompt=prompt), Deadline.after(seconds))
    return reply.answer.text


async def test_a_caller_near_its_deadline_fails_alone_while_queued() -> None:
    cache = DeadlineCache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=8)
    first = asyncio.create_task(ask(coalescer, "a"))
    await cache.single_called.wait()
    short = asyncio.create_task(ask_within(coalescer, "short", 0.05))
    longs = [asyncio.create_task(ask_within(coalescer, p, 30)) for p in ("b", "c")]
    # Its own deadline ends its wait, though the call it queued behind is still out.
    with pytest.raises(CallerDeadline):
        await asyncio.wait_for(short, 10)
    cache.release.set()
    cache.batch_release.set()
    assert await first == "a"
    assert await asyncio.gather(*longs) == ["b", "c"]
    assert cache.batches == [["b", "c"]]  # the caller that gave up is not sent


async def test_a_batch_runs_to_its_latest_callers_deadline_and_each_caller_keeps_its_own() -> None:
    cache = DeadlineCache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=8)
    first = asyncio.create_task(ask(coalescer, "a"))
    await cache.single_called.wait()
    short = asyncio.create_task(ask_within(coalescer, "short", 0.3))
    long = asyncio.create_task(ask_within(coalescer, "long", 30))
    await asyncio.sleep(0)  # both run up to their wait in the queue
    assert len(coalescer._queue) == 2
    cache.release.set()  # "a" returns; the queue goes out as one batch, which the cache holds
    assert await first == "a"
    with pytest.raises(CallerDeadline):
        await asyncio.wait_for(short, 10)  # the short caller gives up at its own deadline...
    assert cache.batches == [["short", "long"]]
    cache.batch_release.set()
    assert await asyncio.wait_for(long, 10) == "long"  # ...and the batch still answers the other


async def feed(coalescer: LookupCoalescer, prompts: list[str]) -> list[asyncio.Task[str]]:
    """One new lookup each loop turn, as a busy gateway's requests reach the cache."""
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(ask(coalescer, prompt)))
        await asyncio.sleep(0)
    return tasks


async def test_a_returning_call_lingers_while_lookups_keep_joining_then_sends_them_as_one() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=64, linger_turns=3)
    coalescer.linger_max = 30.0  # only the quiet turns end the linger here
    first = asyncio.create_task(ask(coalescer, "a"))
    await cache.single_called.wait()
    queued = asyncio.create_task(ask(coalescer, "b"))
    await asyncio.sleep(0)
    cache.release.set()  # "a" returns while c0..c4 keep arriving, one a turn
    fed = await feed(coalescer, [f"c{i}" for i in range(5)])
    assert await first == "a"
    assert await asyncio.gather(queued, *fed) == ["b", *(f"c{i}" for i in range(5))]
    # Without the linger "b" would have gone alone as "a" returned; it waited for the rest.
    assert cache.singles == ["a"] and cache.batches == [["b", "c0", "c1", "c2", "c3", "c4"]]
    assert coalescer.calls == 2 and coalescer.sent == 7 and coalescer.in_flight == 0


async def test_a_full_batch_ends_the_linger_at_once() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=3, linger_turns=3)
    coalescer.linger_max = 30.0
    first = asyncio.create_task(ask(coalescer, "a"))
    await cache.single_called.wait()
    queued = asyncio.create_task(ask(coalescer, "b"))
    await asyncio.sleep(0)
    cache.release.set()
    fed = await feed(coalescer, ["c0", "c1", "c2"])
    assert await first == "a"
    assert await asyncio.gather(queued, *fed) == ["b", "c0", "c1", "c2"]
    assert cache.batches[0] == ["b", "c0", "c1"]  # sent when the third joined, not after the linger


async def test_a_lingering_lookup_keeps_its_own_deadline() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=64, linger_turns=10**9)
    coalescer.linger_max = 1.0  # a linger that would outlast the caller
    first = asyncio.create_task(ask(coalescer, "a"))
    await cache.single_called.wait()
    short = asyncio.create_task(ask_within(coalescer, "short", 0.05))
    await asyncio.sleep(0)
    cache.release.set()
    assert await first == "a"
    with pytest.raises(CallerDeadline):
        await asyncio.wait_for(short, 10)
    assert cache.batches == []  # it gave up while the queue lingered, and was never sent
