"""Stopping background tasks for certain.

A task's `cancel()` asks once, and the request can be lost: on Python 3.11 `asyncio.wait_for`
returns the inner result when the cancellation arrives as the inner call completes (fixed in
3.12), and client libraries built on it (redis-py's pipelines, our own timeouts) inherit that.
A loop that lost its cancellation sleeps and runs again, and whoever awaited it after one
`cancel()` waits forever: a gateway's key-limit sync once hung a shutdown this way. `stop`
repeats the request until the task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

# How long one cancellation request may take to land before it is repeated: the task has a
# whole event-loop turn to react, so a repeat only happens when one was really swallowed.
RECANCEL_S = 0.05


async def stop(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancels every task and returns once each has ended (its result or error discarded)."""
    await stop_all(t for t in tasks if t is not None)


async def stop_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in every:  # retrieved, so none is logged as "exception was never retrieved"
        if not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()
