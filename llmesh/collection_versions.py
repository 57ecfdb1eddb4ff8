"""Collection versions in Redis: the one counter per (tenant, collection) that every retrieval
replica bumps and the answer cache reads.

A version is a Redis integer, raised by an atomic server-side script (so two replicas ingesting
at once always get two distinct versions). Retrieval bumps it before it writes a chunk and again
once the last write landed, both before the ingest is acknowledged; the cache reads it in the
same round trip as every exact-tier lookup with a collection, and an entry cached under any
other version is a miss. So an answer cached before an ingest is never served once the ingest
has returned, on any gateway, whatever version a gateway still believes.

The keys carry no TTL: under a `volatile-*` eviction policy they are never evicted (cached
answers, which have one, are). Retrieval also keeps the last version it wrote in its own store
(Qdrant) and passes it as a floor, so a Redis that lost its data resumes above every version
handed out before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

PREFIX = "llmesh:collection-version:"

# KEYS[1]: the version key; ARGV[1]: the floor. Returns the new version: max(current, floor) + 1.
BUMP_SCRIPT = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1]) or 0
if current < floor then current = floor end
current = current + 1
redis.call('SET', KEYS[1], current)
return current
"""


def version_key(tenant: str, collection: str, prefix: str = PREFIX) -> str:
    """The Redis key of one collection's version (a digest: names may hold any character)."""
    digest = hashlib.sha256(f"{tenant}\0{collection}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix}{digest}"


async def bump(redis: Any, tenant: str, collection: str, floor: int = 0, prefix: str = PREFIX) -> int:
    """Raises the version atomically and returns the new value (above `floor`)."""
    return int(await redis.eval(BUMP_SCRIPT, 1, version_key(tenant, collection, prefix), int(floor)))


async def read(redis: Any, tenant: str, collection: str, prefix: str = PREFIX) -> int:
    """The current version (0 for a collection never written)."""
    value = await redis.get(version_key(tenant, collection, prefix))
    return int(value) if value is not None else 0


async def restore(redis: Any, tenant: str, collection: str, recorded: int, prefix: str = PREFIX) -> int:
    """Sets a missing version to `recorded` (what retrieval's own store last wrote) unless one was
    set meanwhile; returns the version now."""
    key = version_key(tenant, collection, prefix)
    await redis.set(key, int(recorded), nx=True)
    value = await redis.get(key)
    return int(value) if value is not None else int(recorded)


def parse(values: Sequence[Any]) -> list[int]:
    """Versions from the replies of pipelined GETs of `version_key`s (None: 0)."""
    return [int(v) if v is not None else 0 for v in values]


def connect(url: str, timeout: float) -> Any:
    """A Redis client that fails fast (socket and connect timeouts, no retries): the versions' and
    the answer cache's."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
    )
