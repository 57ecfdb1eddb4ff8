"""llmesh.tasks.stop: a background loop is stopped even when it loses a cancellation."""

from __future__ import annotations

import asyncio

from llmesh import tasks


async def test_a_loop_that_loses_its_cancellation_to_wait_for_is_still_stopped() -> None:
    """The gateway's key-limit sync: a cancellation landing as the awaited reply completes is
    swallowed by 3.11's wait_for, and the loop goes on to its next round."""
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
    rounds = 0

    async def sync_loop() -> None:
        nonlocal rounds
        while True:
            reply = loop.create_future()
            await replies.put(reply)
            await asyncio.wait_for(reply, 5)
            rounds += 1

    task = loop.create_task(sync_loop())
    first = await replies.get()
    # The reply and the cancellation in one loop turn, as when Redis answers during a shutdown.
    first.set_result(1)
    task.cancel()
    await tasks.stop(task)
    assert task.done()
    assert task.cancelled()


async def test_stop_ends_every_task_and_retrieves_their_errors() -> None:
    never = asyncio.get_running_loop().create_future()

    async def waits() -> None:
        await never

    async def fails() -> None:
        raise RuntimeError("boom")

    waiting, failing = asyncio.create_task(waits()), asyncio.create_task(fails())
    await asyncio.sleep(0)  # both start; `fails` ends with its error
    await tasks.stop(waiting, failing, None)
    assert waiting.cancelled()
    assert isinstance(failing.exception(), RuntimeError)
    await tasks.stop_all([])  # nothing to stop is fine
