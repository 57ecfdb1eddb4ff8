"""The cache's health as the gateway's lookups see it: when the cache last answered a lookup in
full (a patient request waits while it keeps answering), and whether it failed, ran out of its
budget or answered degraded lately (then requests decide admission before looking it up). One per
gateway, shared by every request's path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from llmesh.v1 import cache_pb2

# ...checking every this long that the cache answered something within the last this long.
CACHE_ALIVE_S = 0.01
# After the cache failed or answered degraded, requests decide admission before looking it up
# for this long.
CACHE_SUSPECT_S = 1.0


class CacheHealth:
    """`breaker_closed`: whether the cache's circuit breaker is closed now (read on each call)."""

    def __init__(self, breaker_closed: Callable[[], bool]) -> None:
        self.breaker_closed = breaker_closed
        self.slow_until = 0.0
        self.answered_at = 0.0

    def heard(self, lookup: asyncio.Future[Any]) -> None:
        """Notes when the cache last answered a lookup in full (not degraded): the liveness a
        patient request waits on. A done callback of each lookup."""
        if not lookup.cancelled() and lookup.exception() is None and not lookup.result().degraded:
            self.answered_at = time.monotonic()

    def failed(self) -> None:
        """The cache failed, ran out of its budget or answered degraded: suspect for CACHE_SUSPECT_S."""
        self.slow_until = time.monotonic() + CACHE_SUSPECT_S

    def suspect(self) -> bool:
        """The cache failed, ran out of budget or answered degraded in the last CACHE_SUSPECT_S,
        or its breaker is not closed."""
        return time.monotonic() < self.slow_until or not self.breaker_closed()

    async def wait_while_answering(
        self, lookup: asyncio.Future[cache_pb2.CacheLookupResponse], until: float
    ) -> cache_pb2.CacheLookupResponse:
        """Waits for `lookup` in steps of CACHE_ALIVE_S, each only while the cache answered some
        other lookup in full within the last step (it is busy, not frozen: this answer is likely
        on its way; lookups go out in batches), until `until`; raises TimeoutError when it stops."""
        while True:
            now = time.monotonic()
            if now >= until or now - self.answered_at > CACHE_ALIVE_S:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(lookup), min(CACHE_ALIVE_S, until - now))
            except TimeoutError:
                continue
