"""The event-loop lag every service exports (llmesh_event_loop_lag_seconds)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import REGISTRY

from llmesh.server import watch_loop_lag
from llmesh.testing import eventually


def lag(sample: str) -> float:
    return REGISTRY.get_sample_value(f"llmesh_event_loop_lag_seconds_{sample}") or 0.0


async def test_a_blocked_loop_shows_as_lag() -> None:
    count, total = lag("count"), lag("sum")
    monitor = asyncio.create_task(watch_loop_lag(0.005))
    await asyncio.sleep(0)  # the monitor arms its first timer
    # A callback that blocks the loop for 50 ms: the monitor's timer, due in 5 ms, is overdue
    # when it ends and runs before anything armed later.
    asyncio.get_running_loop().call_soon(time.sleep, 0.05)  # simulated work: a blocking callback
    await eventually(lambda: lag("count") > count, 5.0, message="the monitor never sampled")
    monitor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await monitor
    assert lag("count") > count
    assert lag("sum") - total >= 0.04
