"""The gateway's lookup coalescing, on its own: which lookups go alone, which go together."""

from __future__ import annotations

import asyncio

import pytest

from llmesh.v1 import cache_pb2
from services.gateway.peers import Deadline, LookupCoalescer


class Cache:
    """Answers each prompt with itself as the answer text, once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.singles: list[str] = []
        self.batches: list[list[str]] = []
        self.fail = False

    def answer(self, request: cache_pb2.CacheLookupRequest) -> cache_pb2.CacheLookupResponse:
        return cache_pb2.CacheLookupResponse(hit=True, answer=cache_pb2.CachedAnswer(text=request.prompt))

    async def lookup(self, request: cache_pb2.CacheLookupRequest, deadline: Deadline) -> cache_pb2.CacheLookupResponse:
        assert 0 < deadline.remaining() <= 5.0  # the caller's deadline (the hop budget is Peers')
        self.singles.append(request.prompt)
        await self.release.wait()
        if self.fail:
            raise RuntimeError("cache down")
        return self.answer(request)

    async def lookup_batch(
        self, request: cache_pb2.CacheLookupBatchRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupBatchResponse:
        self.batches.append([r.prompt for r in request.requests])
        await self.release.wait()
        if self.fail:
            raise RuntimeError("cache down")
        return cache_pb2.CacheLookupBatchResponse(results=[self.answer(r) for r in request.requests])


async def ask(coalescer: LookupCoalescer, prompt: str) -> str:
    reply = await coalescer.lookup(cache_pb2.CacheLookupRequest(prompt=prompt), Deadline.after(5))
    return reply.answer.text


async def test_lookups_go_alone_until_calls_are_in_flight_then_together() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=2, max_batch=3)
    tasks = [asyncio.create_task(ask(coalescer, f"q{i}")) for i in range(7)]
    await asyncio.sleep(0.01)
    assert cache.singles == ["q0", "q1"] and cache.batches == []  # two out, five queued
    cache.release.set()
    answers = await asyncio.gather(*tasks)
    assert answers == [f"q{i}" for i in range(7)]  # every caller gets its own answer
    # Each returning call sent up to max_batch of the queue as one LookupBatch.
    assert cache.batches == [["q2", "q3", "q4"], ["q5", "q6"]]
    assert cache.singles == ["q0", "q1"]
    assert coalescer.in_flight == 0


async def test_a_failed_batch_fails_each_of_its_callers_and_a_cancelled_caller_is_skipped() -> None:
    cache = Cache()
    coalescer = LookupCoalescer(cache.lookup, cache.lookup_batch, in_flight=1, max_batch=8)
    first = asyncio.create_task(ask(coalescer, "a"))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(ask(coalescer, p)) for p in ("b", "c", "d")]
    await asyncio.sleep(0.01)
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
