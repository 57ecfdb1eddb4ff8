"""Collection versions as the gateway knows them, off the hit path (`CollectionVersions`): the
retrieval upstream owns one (services/gateway/upstream.py), and each request's path reads it
through that upstream and updates it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmesh.errors import LlmeshError
from llmesh.v1 import retrieval_pb2
from services.gateway.deadline import Deadline
from services.gateway.hop_errors import DOWNSTREAM_ERRORS

log = logging.getLogger("llmesh.gateway")

# Background calls (version refresh, cache store) have no caller: a deadline well past any hop
# budget, so the budget bounds them and its timeout counts against the hop.
BACKGROUND_DEADLINE_S = 30.0

# Retrieval's GetCollectionInfo: (collection, tenant, deadline) -> its info.
AskInfo = Callable[[str, str, Deadline], Awaitable[retrieval_pb2.CollectionInfo]]


@dataclass
class KnownVersion:
    """A collection's version as last learned from retrieval."""

    info: retrieval_pb2.CollectionInfo
    learned_at: float
    # The last refresh failed: answers grounded in this version are marked degraded.
    unconfirmed: bool = False
    refreshing: asyncio.Task[None] | None = None


class CollectionVersions:
    """Collection versions off the hit path: learned once, trusted for `ttl` seconds, then served
    while a single background refresh asks retrieval again (stale-while-revalidate). An ingest
    through this gateway forgets the entry, so the next request learns the new version at once;
    other replicas learn it within `ttl`. While retrieval is down the last known version is kept
    (marked unconfirmed, and asked again on every request until retrieval answers), so cached
    answers for it still serve."""

    MAX_ENTRIES = 4096

    def __init__(
        self, ask: Callable[[str, str, Deadline], Awaitable[retrieval_pb2.CollectionInfo]], ttl: float
    ) -> None:
        self.ask = ask  # retrieval's GetCollectionInfo (collection, tenant, deadline)
        self.ttl = ttl
        self.known: dict[tuple[str, str], KnownVersion] = {}

    async def get(self, collection: str, tenant: str, deadline: Deadline) -> KnownVersion:
        """The known version (refreshed in the background when older than ttl); the first time,
        retrieval is asked in the request's path and its errors are raised."""
        key = (tenant, collection)
        known = self.known.get(key)
        if known is None:
            info = await self.ask(collection, tenant, deadline)
            if len(self.known) >= self.MAX_ENTRIES:
                self.known.pop(next(iter(self.known)))
            known = self.known[key] = KnownVersion(info, time.monotonic())
            return known
        # An unconfirmed version is asked again at once (one call at a time): retrieval's return
        # is noticed on the next request, not a TTL later.
        stale = known.unconfirmed or time.monotonic() - known.learned_at >= self.ttl
        if stale and known.refreshing is None:
            known.refreshing = asyncio.get_running_loop().create_task(self._refresh(key, known))
        return known

    async def _refresh(self, key: tuple[str, str], known: KnownVersion) -> None:
        tenant, collection = key
        try:
            # No caller waits: the hop's own budget bounds the call, and its timeout is a verdict.
            info = await self.ask(collection, tenant, Deadline.after(BACKGROUND_DEADLINE_S))
        except (*DOWNSTREAM_ERRORS, LlmeshError) as exc:
            known.unconfirmed = True
            log.warning("collection version refresh failed, keeping version %d: %s", known.info.version, exc.message)
        else:
            known.info, known.unconfirmed = info, False
        finally:
            known.learned_at = time.monotonic()
            known.refreshing = None

    def forget(self, collection: str, tenant: str) -> None:
        self.known.pop((tenant, collection), None)

    def observe(self, collection: str, tenant: str, version: int) -> None:
        """A newer version seen elsewhere (the cache's lookup, a search): trusted from now on."""
        known = self.known.get((tenant, collection))
        if known is not None and version > known.info.version:
            info = retrieval_pb2.CollectionInfo()
            info.CopyFrom(known.info)
            info.version = version
            known.info, known.learned_at, known.unconfirmed = info, time.monotonic(), False
