"""The bounds of an ingest without servers: the shared chunk window, the gateway's ingest budget
(fake clock) and retrieval's per-document locks."""

from __future__ import annotations

import asyncio

import pytest

from llmesh import chunking
from llmesh.errors import ResourceExhausted
from services.gateway.ingest import INITIAL_BYTES_PER_SECOND, MAX_RETRY_S, MIN_RETRY_S, REASON_BUSY, IngestBudget
from services.retrieval.core import DocumentLocks


def test_windows_outside_the_bounds_name_their_field() -> None:
    assert chunking.window_violations(16, 8) == [] and chunking.window_violations(2048, 1024) == []
    for window in (0, 1, 15, 2049, 8192):
        assert [f for f, _ in chunking.window_violations(window, 0)] == ["chunk_tokens"]
    assert [f for f, _ in chunking.window_violations(200, 101)] == ["overlap_tokens"]
    # A request's 0 is the server's default: only what it shows on its own is refused.
    assert chunking.request_violations(0, 0) == [] and chunking.request_violations(0, 1024) == []
    assert [f for f, _ in chunking.request_violations(0, 1025)] == ["overlap_tokens"]
    assert [f for f, _ in chunking.request_violations(8192, 8191)] == ["chunk_tokens"]


def test_chunk_count_is_the_number_of_windows_the_tokenizer_makes() -> None:
    def windows(total: int, chunk: int, overlap: int) -> int:
        made, start = 0, 0
        while start < total:
            made += 1
            if start + chunk >= total:
                break
            start += chunk - overlap
        return made

    for total in (0, 1, 15, 16, 17, 200, 201, 367, 1000):
        for chunk, overlap in ((16, 0), (16, 8), (200, 32), (24, 4)):
            assert chunking.chunk_count(total, chunk, overlap) == windows(total, chunk, overlap), (total, chunk)
    # The default ceiling holds the largest default document at the default window.
    assert chunking.chunk_count(1024 * 1024, 200, 32) <= chunking.DEFAULT_MAX_CHUNKS_PER_DOCUMENT


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_ingest_budget_refuses_what_does_not_fit_with_a_retry_delay_and_learns_the_rate() -> None:
    clock = FakeClock()
    budget = IngestBudget(1000, clock)
    with budget.admit(600):
        assert budget.in_flight == 600
        with budget.admit(400):
            assert budget.in_flight == 1000
        with pytest.raises(ResourceExhausted) as refused:
            with budget.admit(500):
                pass
        assert refused.value.reason == REASON_BUSY
        assert refused.value.retry_after == MIN_RETRY_S  # 100 bytes at the initial rate: under a second
        clock.now += 0.01  # 600 bytes in 10 ms: the learned rate rises
    assert budget.in_flight == 0 and budget.rate > INITIAL_BYTES_PER_SECOND
    # Heavier than the whole budget: runs alone, and nothing fits beside it.
    with budget.admit(5000):
        assert budget.in_flight == 1000
        with pytest.raises(ResourceExhausted):
            with budget.admit(1):
                pass
    # A failed ingest gives its bytes back and teaches no rate.
    rate = budget.rate
    with pytest.raises(RuntimeError), budget.admit(100):
        raise RuntimeError("retrieval failed")
    assert budget.in_flight == 0 and budget.rate == rate
    slow = IngestBudget(10**9, clock)
    slow.rate = 1.0
    with slow.admit(10**9), pytest.raises(ResourceExhausted) as refused:
        with slow.admit(10**9):
            pass
    assert refused.value.retry_after == MAX_RETRY_S


async def test_document_locks_serialise_one_document_and_forget_it_after() -> None:
    waits: list[tuple[str, str]] = []
    waited = asyncio.Event()

    def on_wait(physical: str, doc: str) -> None:
        waits.append((physical, doc))
        waited.set()

    locks = DocumentLocks(on_wait)
    order: list[str] = []
    first_in = asyncio.Event()
    release = asyncio.Event()

    async def first() -> None:
        async with locks.hold("c", ["b", "a"]):
            order.append("first in")
            first_in.set()
            await release.wait()
            order.append("first out")

    async def second() -> None:
        async with locks.hold("c", ["a"]):
            order.append("second in")

    async def elsewhere() -> None:
        async with locks.hold("other", ["a"]):  # another collection's "a" is another document
            order.append("elsewhere")

    one = asyncio.create_task(first())
    await first_in.wait()
    two = asyncio.create_task(second())
    await asyncio.create_task(elsewhere())
    await waited.wait()  # second() reports its wait as it parks on the lock
    release.set()
    await asyncio.gather(one, two)
    assert order == ["first in", "elsewhere", "first out", "second in"]
    assert waits == [("c", "a")]
    assert len(locks) == 0
    # A waiter that is cancelled leaves nothing behind either.
    async with locks.hold("c", ["a"]):
        waited.clear()
        waiter = asyncio.create_task(second())
        await waited.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert len(locks) == 0
