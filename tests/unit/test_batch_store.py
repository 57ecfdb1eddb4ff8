"""The batch store's claims on a real Redis (the embedded valkey): a line is claimed by one runner
at a time, claimed again once its lease runs out (its runner died), completed once whoever
finishes it, and never recorded after its job was finalized or cancelled past running."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from services.gateway.batches.store import ERROR, OUTPUT, BatchStore


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[BatchStore]:
    client = Redis.from_url(redis_url)
    yield BatchStore(client, prefix="test:batch:")
    await client.aclose()


async def job(store: BatchStore, lines: int, failed: tuple[int, ...] = ()) -> str:
    fields = {
        "id": "batch-1",
        "tenant": "acme",
        "status": "in_progress",
        "created_at": str(int(time.time())),
        "total": str(lines),
        "completed": "0",
        "cursor": "0",
    }
    runnable = {i: json.dumps({"custom_id": f"c{i}", "body": {}}) for i in range(lines) if i not in failed}
    await store.create_batch(fields, runnable, {i: "{}" for i in failed})
    return fields["id"]


async def test_each_line_is_claimed_by_one_runner_and_lines_failed_at_validation_never(store: BatchStore) -> None:
    batch = await job(store, 5, failed=(2,))
    first = await store.claim(batch, 2, lease_s=30)
    second = await store.claim(batch, 10, lease_s=30)
    assert first == [0, 1] and second == [3, 4]
    assert await store.claim(batch, 10, lease_s=30) == []
    assert await store.live_claims(batch) == 4
    info = await store.batch(batch)
    assert info is not None and info.failed == 1


async def test_a_line_whose_lease_ran_out_is_claimed_again_and_completed_once(store: BatchStore) -> None:
    batch = await job(store, 2)
    assert await store.claim(batch, 1, lease_s=0.001) == [0]
    await store.redis.zadd(store.key("batch", batch, "claims"), {"0": 0}, xx=True)  # its lease has run out
    assert await store.claim(batch, 1, lease_s=30) == [0]  # the dead runner's line, before line 1
    assert await store.complete(batch, 0, OUTPUT, "second runner")
    assert not await store.complete(batch, 0, OUTPUT, "first runner, late")
    assert await store.results(batch) == {0: OUTPUT + "second runner"}
    info = await store.batch(batch)
    assert info is not None and (info.completed, info.failed) == (1, 0)
    # A done line is never handed out again, even when a stale claim of it is left over.
    await store.redis.zadd(store.key("batch", batch, "claims"), {"0": 0})
    assert await store.claim(batch, 5, lease_s=30) == [1]


async def test_a_released_line_goes_to_the_next_claim_at_once(store: BatchStore) -> None:
    batch = await job(store, 1)
    assert await store.claim(batch, 1, lease_s=30) == [0]
    await store.release(batch, [0])
    assert await store.live_claims(batch) == 0
    assert await store.claim(batch, 1, lease_s=30) == [0]


async def test_nothing_is_claimed_or_recorded_once_the_job_stops_running(store: BatchStore) -> None:
    batch = await job(store, 3)
    assert await store.claim(batch, 1, lease_s=30) == [0]
    assert await store.transition(batch, ("in_progress",), "cancelling")
    assert await store.claim(batch, 5, lease_s=30) == []
    assert await store.complete(batch, 0, ERROR, "still counted while cancelling")
    assert await store.transition(batch, ("cancelling",), "finalizing")
    assert not await store.transition(batch, ("in_progress",), "cancelling")
    assert not await store.complete(batch, 1, OUTPUT, "too late")
    assert await store.results(batch) == {0: ERROR + "still counted while cancelling"}
