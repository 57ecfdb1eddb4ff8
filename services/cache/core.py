"""Cache domain logic (no gRPC): the exact tier in Redis, the semantic tier in Qdrant, the
near-hit guard, invalidation, and degraded mode when Redis is unreachable.

Redis layout under the key prefix (default "llmesh:cache:"):
  e:<key>           STRING: the serialized answer, TTL'd (all of a batch's exact tier, and the
                    collection versions it needs, in one MGET)
  m:<key>           HASH {p: prompt as asked, t: tenant, c: collection, m: model}, same TTL
  tenant:<sha>      SET of entry keys of one tenant (expires with its longest-lived entry)
  coll:<sha>        SET of entry keys of one tenant grounded in one collection
  model:<sha>       SET of entry keys of one tenant made by one model key
  live              ZSET entry key -> expiry time (entry count for Stats)
Collection versions are retrieval's (llmesh.collection_versions), read in the same round trip
as the exact tier: an entry under any other version than the current one is a miss.
The semantic index is one Qdrant collection per embedding dimension; a point carries the entry
key, the scope's digest and the fields invalidation filters on, and the answer body stays in
Redis, so the Redis TTL governs both: a point whose entry expired is a miss and is deleted when met.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.trace import StatusCode
from prometheus_client import Counter, Gauge, Histogram
from qdrant_client import models as qm
from redis import exceptions as redis_errors

from llmesh import collection_versions
from llmesh.embeddings import Embedder
from llmesh.errors import InvalidArgument, Unavailable
from llmesh.metrics import LATENCY_BUCKETS, trace_exemplar
from llmesh.qdrant import QdrantHandle
from services.cache import guard
from services.cache.keys import Scope, embedding_text, entry_key, name_digest, normalize_prompt

log = logging.getLogger("llmesh.cache")
tracer = trace.get_tracer("llmesh.cache")
T = TypeVar("T")

DEFAULT_PREFIX = "llmesh:cache:"
MAX_PROMPT_BYTES = 64 * 1024
# Candidates in scope above the threshold handed to the near-hit guard, best first.
CANDIDATES = 4
# Payload fields of a semantic point (all indexed): the scope digest the search filters on, and
# what invalidation deletes by.
SCOPE_FIELDS = ("scope", "model", "tenant", "collection", "collection_version")
# The semantic tier answers only among entries of an identical scope: the digest covers all of it.
FILTER_FIELDS = ("scope", "tenant")
INVALIDATE_BATCH = 500
PROBE_MIN_S, PROBE_MAX_S = 0.5, 1.0
SWEEP_INTERVAL_S = 300.0

LOOKUPS = Counter("llmesh_cache_lookups_total", "Cache lookups by tier and result.", ["tier", "result"])
REJECTIONS = Counter(
    "llmesh_cache_semantic_rejections_total", "Semantic candidates refused by the near-hit guard.", ["reason"]
)
STORES = Counter("llmesh_cache_stores_total", "Answers stored in the cache.")
SLOW_REPLIES = Counter(
    "llmesh_cache_redis_slow_replies_total", "Redis replies past the timeout, answered as a miss without degrading."
)
DEGRADED = Gauge("llmesh_cache_degraded", "1 while Redis is unreachable and the cache answers miss.")
LOOKUP_SECONDS = Histogram("llmesh_cache_lookup_duration_seconds", "Cache lookup latency.", buckets=LATENCY_BUCKETS)
for _tier in ("exact", "semantic"):
    for _result in ("hit", "miss"):
        LOOKUPS.labels(_tier, _result)
for _reason in guard.REASONS:
    REJECTIONS.labels(_reason)


class RedisDown(Exception):
    """Redis is unreachable or too slow; the caller answers without it."""


@dataclass
class LookupResult:
    hit: bool = False
    tier: str = ""  # "exact" | "semantic" | ""
    similarity: float = 0.0
    answer: bytes = b""
    key: str = ""
    degraded: bool = False
    # The scope's collection's current version (0 without a collection).
    collection_version: int = 0


@dataclass(frozen=True)
class LookupQuery:
    prompt: str
    scope: Scope
    allow_semantic: bool = True


@dataclass
class StoreResult:
    key: str
    stored: bool
    degraded: bool = False


@dataclass
class Stats:
    entries: int = 0
    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    rejections: int = 0
    degraded: bool = False
    rejections_by_reason: dict[str, int] = field(default_factory=dict)


def redis_client(url: str, timeout: float) -> aioredis.Redis:
    """Client from the URL (user:password@ for ACL, rediss:// for TLS), failing fast: socket and
    connect timeouts of `timeout`, no retries (a miss is cheaper than waiting)."""
    return collection_versions.connect(url, timeout)


def point_id(key: str) -> str:
    return str(uuid.UUID(hex=key[:32]))


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background cache task failed: %s", task.exception())


class CacheCore:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        embedder: Embedder | None,
        qdrant: QdrantHandle | None,
        threshold: float,
        default_ttl: int,
        timeout: float,
        default_collection: str = "docs",
        prefix: str = DEFAULT_PREFIX,
        version_prefix: str = collection_versions.PREFIX,
    ) -> None:
        self.redis = redis
        self.embedder = embedder
        self.qdrant = qdrant
        self.threshold = threshold
        self.default_ttl = default_ttl
        self.timeout = timeout
        self.default_collection = default_collection
        self.prefix = prefix
        self.version_prefix = version_prefix
        self.collection = f"llmesh_cache_d{embedder.dimension}" if embedder is not None else ""
        self.degraded = False
        self._probe: asyncio.Task[None] | None = None
        self._confirming: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.counts = Stats()
        DEGRADED.set(0)

    # ----- lifecycle

    async def start(self) -> None:
        if self.qdrant is not None and self.embedder is not None:
            await self.qdrant.run(self._ensure_collection)
            self._sweeper = asyncio.create_task(self._sweep_loop())
        try:
            await self._redis(lambda: self.redis.ping())
        except RedisDown:
            log.warning("redis unreachable at start: the cache starts degraded (every lookup a miss)")

    async def close(self) -> None:
        for task in (self._probe, self._confirming, self._sweeper, *self._background):
            if task is not None:
                task.cancel()
        await self.redis.aclose()

    def _ensure_collection(self) -> None:
        assert self.qdrant is not None and self.embedder is not None
        client = self.qdrant.client
        if not client.collection_exists(self.collection):
            client.create_collection(
                self.collection,
                # Unit vectors: dot product = cosine, without the engine renormalizing per search.
                vectors_config=qm.VectorParams(size=self.embedder.dimension, distance=qm.Distance.DOT),
            )
        # Every start (idempotent): collections made before these indexes existed, or migrated.
        schema = qm.PayloadSchemaType
        for name in SCOPE_FIELDS:
            kind = schema.INTEGER if name == "collection_version" else schema.KEYWORD
            client.create_payload_index(self.collection, name, kind)
        client.create_payload_index(self.collection, "expires_at", schema.FLOAT)

    # ----- Redis with degraded mode

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def _redis(self, op: Callable[[], Awaitable[T]]) -> T:
        if self.degraded:
            raise RedisDown()
        try:
            async with asyncio.timeout(self.timeout * 4):  # no extra task per call, unlike wait_for
                return await op()
        except (redis_errors.TimeoutError, TimeoutError) as exc:
            # One slow reply (a busy event loop, a long GC) answers this call with a miss but does
            # not take the cache down: that would turn every hit into a generation. Only a ping
            # that fails too marks Redis down.
            self._confirm_down(exc)
            raise RedisDown() from exc
        except (redis_errors.ConnectionError, OSError) as exc:
            self._mark_down(exc)
            raise RedisDown() from exc

    def _confirm_down(self, exc: BaseException) -> None:
        if self._confirming is not None and not self._confirming.done():
            return
        SLOW_REPLIES.inc()

        async def confirm() -> None:
            try:
                await asyncio.wait_for(self.redis.ping(), timeout=self.timeout * 4)
            except (redis_errors.RedisError, TimeoutError, OSError) as ping_exc:
                self._mark_down(ping_exc)
            else:
                log.warning("slow redis reply (%s); a ping answered, so the cache stays up", type(exc).__name__)

        self._confirming = asyncio.create_task(confirm())

    def _mark_down(self, exc: BaseException) -> None:
        if not self.degraded:
            log.warning("redis unreachable (%s: %s): cache degraded, answering miss", type(exc).__name__, exc)
        self.degraded = True
        DEGRADED.set(1)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        delay = PROBE_MIN_S
        while self.degraded:
            await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(self.redis.ping(), timeout=self.timeout * 4)
            except (redis_errors.RedisError, TimeoutError, OSError):
                delay = min(delay * 2, PROBE_MAX_S)
                continue
            # Pooled connections opened before the outage are dead; drop them so the first
            # requests after recovery do not fail on them and mark the cache degraded again.
            await self.redis.connection_pool.disconnect(inuse_connections=False)
            self.degraded = False
            DEGRADED.set(0)
            log.info("redis reachable again: cache recovered")

    # ----- lookup

    def _check_prompt(self, prompt: str) -> None:
        if not prompt.strip():
            raise InvalidArgument([("prompt", "must not be empty")])
        if len(prompt.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
            raise InvalidArgument([("prompt", f"longer than {MAX_PROMPT_BYTES} bytes")])

    @staticmethod
    def _check_scope(scope: Scope) -> None:
        if not scope.model:
            raise InvalidArgument([("scope.model", "required: answers are cached per model")])

    async def lookup(self, prompt: str, scope: Scope, allow_semantic: bool) -> LookupResult:
        return (await self.lookup_many([LookupQuery(prompt, scope, allow_semantic)]))[0]

    async def lookup_many(self, queries: Sequence[LookupQuery]) -> list[LookupResult]:
        """Results in query order; the exact tier of all of them in one Redis round trip."""
        for i, query in enumerate(queries):
            try:
                self._check_prompt(query.prompt)
                self._check_scope(query.scope)
            except InvalidArgument as exc:
                if len(queries) == 1:
                    raise
                raise InvalidArgument([(f"requests[{i}].{field}", why) for field, why in exc.violations]) from None
        started = time.perf_counter()
        try:
            results = await self._lookup_many(queries)
        finally:
            elapsed = time.perf_counter() - started
            exemplar = trace_exemplar()
            for _ in queries:
                LOOKUP_SECONDS.observe(elapsed, exemplar=exemplar)
        for result in results:
            if not result.hit:
                self.counts.misses += 1
            elif result.tier == "exact":
                self.counts.exact_hits += 1
            else:
                self.counts.semantic_hits += 1
        return results

    async def _hget_many(self, keys: list[str], versions: list[str]) -> list[Any]:
        """The answers under `keys`, then the values of the version keys `versions`: one command
        (a pipeline of one command per key costs the client several times more)."""
        if len(keys) == 1 and not versions:
            return [await self.redis.get(self._k("e", keys[0]))]
        return list(await self.redis.mget([self._k("e", key) for key in keys] + versions))

    async def _lookup_many(self, queries: Sequence[LookupQuery]) -> list[LookupResult]:
        normalized = [normalize_prompt(q.prompt) for q in queries]
        keys = [entry_key(n, q.scope) for n, q in zip(normalized, queries, strict=True)]
        # The current version of each collection asked about, read with the answers.
        version_keys = list(
            dict.fromkeys(
                collection_versions.version_key(q.scope.tenant, q.scope.collection, self.version_prefix)
                for q in queries
                if q.scope.collection
            )
        )
        # Not made current: nothing runs inside it, and every exact hit pays for this span.
        span = tracer.start_span("cache.redis.get", attributes={"llmesh.cache.tier": "exact"})
        try:
            if len(queries) > 1:
                span.set_attribute("llmesh.cache.batch_size", len(queries))
            try:
                replies = await self._redis(lambda: self._hget_many(keys, version_keys))
            except RedisDown:
                span.set_attribute("llmesh.cache.degraded", True)
                LOOKUPS.labels("exact", "miss").inc(len(queries))
                return [LookupResult(degraded=True) for _ in queries]
            except redis_errors.RedisError as exc:
                log.error("redis lookup failed: %s", exc)
                span.set_status(StatusCode.ERROR, type(exc).__name__)
                LOOKUPS.labels("exact", "miss").inc(len(queries))
                return [LookupResult() for _ in queries]
            answers = replies[: len(keys)]
            current = dict(zip(version_keys, collection_versions.parse(replies[len(keys) :]), strict=True))
            versions = [
                current[collection_versions.version_key(q.scope.tenant, q.scope.collection, self.version_prefix)]
                if q.scope.collection
                else 0
                for q in queries
            ]
            # An entry under another version than the collection's current one is stale (or ahead
            # of a Redis that lost its data): a miss, in both tiers.
            fresh = [v == q.scope.collection_version for v, q in zip(versions, queries, strict=True)]
            answers = [a if ok else None for a, ok in zip(answers, fresh, strict=True)]
            hits = sum(answer is not None for answer in answers)
            if hits == len(queries):
                span.set_attribute("llmesh.cache.similarity", 1.0)
        finally:
            span.end()
        if hits:
            LOOKUPS.labels("exact", "hit").inc(hits)
        if hits < len(queries):
            LOOKUPS.labels("exact", "miss").inc(len(queries) - hits)
        results = [
            LookupResult(True, "exact", 1.0, _as_bytes(answer), key, collection_version=version)
            if answer is not None
            else LookupResult(collection_version=version)
            for answer, key, version in zip(answers, keys, versions, strict=True)
        ]
        if self.embedder is None or self.qdrant is None:
            return results
        semantic = [i for i, q in enumerate(queries) if q.allow_semantic and fresh[i] and not results[i].hit]
        found = await asyncio.gather(*(self._semantic(queries[i].prompt, queries[i].scope) for i in semantic))
        for i, result in zip(semantic, found, strict=True):
            LOOKUPS.labels("semantic", "hit" if result.hit else "miss").inc()
            result.collection_version = versions[i]
            results[i] = result
        return results

    def _scope_payload(self, scope: Scope) -> dict[str, Any]:
        assert self.embedder is not None
        return {
            "scope": f"{scope.digest()}:{self.embedder.digest[:16]}",
            "model": scope.model,
            "tenant": scope.tenant,
            "collection": scope.collection,
            "collection_version": scope.collection_version,
        }

    async def _semantic(self, prompt: str, scope: Scope) -> LookupResult:
        assert self.embedder is not None and self.qdrant is not None
        with tracer.start_as_current_span("cache.embed") as span:
            span.set_attribute("llmesh.cache.tier", "semantic")
            try:
                vector = (await self.embedder.aencode([embedding_text(prompt)]))[0]
            except Exception as exc:  # the semantic tier is best effort: a miss, never an error
                log.warning("embedding failed: %s", exc)
                return LookupResult()
        want = self._scope_payload(scope)
        with tracer.start_as_current_span("cache.qdrant.search") as span:
            span.set_attribute("llmesh.cache.tier", "semantic")
            try:
                candidates = await self.qdrant.run(self._search, vector, want)
            except Exception as exc:
                log.warning("semantic search failed: %s", exc)
                return LookupResult()
            span.set_attribute("llmesh.cache.candidates", len(candidates))
            if candidates:
                span.set_attribute("llmesh.cache.similarity", float(candidates[0][1]))
        if not candidates:
            return LookupResult()
        with tracer.start_as_current_span("cache.redis.get") as span:
            span.set_attribute("llmesh.cache.tier", "semantic")

            async def fetch() -> list[Any]:
                pipe = self.redis.pipeline(transaction=False)
                for key, _ in candidates:
                    pipe.get(self._k("e", key))
                    pipe.hget(self._k("m", key), "p")
                replies = await pipe.execute()
                return list(zip(replies[::2], replies[1::2], strict=True))

            try:
                rows = await self._redis(fetch)
            except RedisDown:
                return LookupResult(degraded=True)
            except redis_errors.RedisError as exc:
                log.error("redis lookup failed: %s", exc)
                return LookupResult()
        expired: list[str] = []
        asked = guard.features(prompt)
        result = LookupResult()
        for (key, score), (answer, cached_prompt) in zip(candidates, rows, strict=True):
            if answer is None or cached_prompt is None:
                expired.append(key)
                continue
            reason = guard.check(asked, _as_bytes(cached_prompt).decode("utf-8", "replace"))
            if reason is not None:
                REJECTIONS.labels(reason).inc()
                self.counts.rejections += 1
                self.counts.rejections_by_reason[reason] = self.counts.rejections_by_reason.get(reason, 0) + 1
                trace.get_current_span().add_event("llmesh.cache.rejected", {"reason": reason, "similarity": score})
                continue
            result = LookupResult(True, "semantic", min(1.0, max(0.0, float(score))), _as_bytes(answer), key)
            break
        if expired:
            self._spawn(self.qdrant.run(self._delete_points, [point_id(k) for k in expired]))
        trace.get_current_span().set_attribute("llmesh.cache.similarity", result.similarity)
        return result

    def _search(self, vector: np.ndarray, want: dict[str, Any]) -> list[tuple[str, float]]:
        """(entry key, similarity) of the points in scope above the threshold, best first."""
        assert self.qdrant is not None
        client = self.qdrant.client
        flt = qm.Filter(must=[qm.FieldCondition(key=f, match=qm.MatchValue(value=want[f])) for f in FILTER_FIELDS])
        found = client.query_points(
            self.collection,
            query=vector.tolist(),
            query_filter=flt,
            limit=CANDIDATES,
            score_threshold=self.threshold,
            with_payload=["key"],
        ).points
        return [(p.payload["key"], p.score) for p in found if p.payload]

    def _delete_points(self, ids: list[str]) -> None:
        assert self.qdrant is not None
        selector = qm.PointIdsList(points=list[qm.ExtendedPointId](ids))
        self.qdrant.client.delete(self.collection, points_selector=selector)

    def _delete_where(self, match: dict[str, str]) -> None:
        assert self.qdrant is not None
        flt = qm.Filter(must=[qm.FieldCondition(key=k, match=qm.MatchValue(value=v)) for k, v in match.items()])
        self.qdrant.client.delete(self.collection, points_selector=qm.FilterSelector(filter=flt))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    # ----- store

    async def store(self, prompt: str, scope: Scope, answer: bytes, ttl_seconds: int = 0) -> StoreResult:
        self._check_prompt(prompt)
        self._check_scope(scope)
        normalized = normalize_prompt(prompt)
        key = entry_key(normalized, scope)
        ttl = int(ttl_seconds) or self.default_ttl
        expires_at = time.time() + ttl
        ekey, mkey = self._k("e", key), self._k("m", key)

        async def write() -> list[Any]:
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(ekey, answer, ex=ttl)
            pipe.delete(mkey)
            pipe.hset(mkey, mapping={"p": prompt, "t": scope.tenant, "c": scope.collection, "m": scope.model})
            pipe.expire(mkey, ttl)
            sets = [
                self._k("tenant", name_digest(scope.tenant)),
                self._k("model", name_digest(scope.tenant, scope.model)),
            ]
            if scope.collection:
                sets.append(self._k("coll", name_digest(scope.tenant, scope.collection)))
            for set_key in sets:
                pipe.sadd(set_key, key)
                pipe.expire(set_key, ttl, nx=True)
                pipe.expire(set_key, ttl, gt=True)
            live = self._k("live")
            pipe.zremrangebyscore(live, "-inf", time.time())
            pipe.zadd(live, {key: expires_at})
            return await pipe.execute()

        with tracer.start_as_current_span("cache.redis.store") as span:
            span.set_attribute("llmesh.cache.tier", "exact")
            try:
                await self._redis(write)
            except RedisDown:
                span.set_attribute("llmesh.cache.degraded", True)
                return StoreResult(key, False, True)
            except redis_errors.RedisError as exc:
                log.error("redis store failed: %s", exc)
                return StoreResult(key, False)
        STORES.inc()
        if self.embedder is not None and self.qdrant is not None:
            try:
                await self._index(prompt, scope, key, expires_at)
            except Exception as exc:  # the exact tier has the entry; the semantic index is best effort
                log.warning("semantic index write failed: %s", exc)
        return StoreResult(key, True)

    async def _index(self, prompt: str, scope: Scope, key: str, expires_at: float) -> None:
        assert self.embedder is not None and self.qdrant is not None
        with tracer.start_as_current_span("cache.embed") as span:
            span.set_attribute("llmesh.cache.tier", "semantic")
            vector = (await self.embedder.aencode([embedding_text(prompt)]))[0]
        payload = {**self._scope_payload(scope), "key": key, "expires_at": expires_at}
        point = qm.PointStruct(id=point_id(key), vector=vector.tolist(), payload=payload)
        with tracer.start_as_current_span("cache.qdrant.upsert"):
            await self.qdrant.run(self.qdrant.client.upsert, self.collection, points=[point])

    # ----- invalidation (always within one tenant)

    async def invalidate_key(self, tenant: str, key: str) -> int:
        """Removes one entry, if it is the tenant's."""
        key = key.strip().lower()
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise InvalidArgument([("key", "must be a cache key as returned by Lookup or Store (64 hex digits)")])
        ekey, mkey = self._k("e", key), self._k("m", key)

        async def remove() -> int:
            owner, collection, model = await self.redis.hmget(mkey, "t", "c", "m")
            if owner is None or _as_bytes(owner).decode() != tenant:
                return 0  # none, or another tenant's: never removed across tenants
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(ekey)
            pipe.delete(mkey)
            pipe.zrem(self._k("live"), key)
            pipe.srem(self._k("tenant", name_digest(tenant)), key)
            if collection:
                pipe.srem(self._k("coll", name_digest(tenant, _as_bytes(collection).decode())), key)
            if model:
                pipe.srem(self._k("model", name_digest(tenant, _as_bytes(model).decode())), key)
            return int((await pipe.execute())[0])

        removed = await self._must(remove)
        if removed:
            await self._qdrant_cleanup(self._delete_points, [point_id(key)])
        return removed

    async def invalidate_tenant(self, tenant: str) -> int:
        removed = await self._must(lambda: self._drop_set(self._k("tenant", name_digest(tenant))))
        await self._qdrant_cleanup(self._delete_where, {"tenant": tenant})
        return removed

    async def invalidate_collection(self, tenant: str, collection: str) -> int:
        collection = collection or self.default_collection
        removed = await self._must(lambda: self._drop_set(self._k("coll", name_digest(tenant, collection))))
        await self._qdrant_cleanup(self._delete_where, {"tenant": tenant, "collection": collection})
        return removed

    async def invalidate_model(self, tenant: str, model: str) -> int:
        removed = await self._must(lambda: self._drop_set(self._k("model", name_digest(tenant, model))))
        await self._qdrant_cleanup(self._delete_where, {"tenant": tenant, "model": model})
        return removed

    async def _drop_set(self, set_key: str) -> int:
        # Read and delete the set atomically: a concurrent Store lands in a new set.
        pipe = self.redis.pipeline(transaction=True)
        pipe.smembers(set_key)
        pipe.delete(set_key)
        members, _ = await pipe.execute()
        keys = sorted(m.decode() for m in members)
        removed = 0
        for i in range(0, len(keys), INVALIDATE_BATCH):
            chunk = keys[i : i + INVALIDATE_BATCH]
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(*[self._k("e", k) for k in chunk])
            pipe.delete(*[self._k("m", k) for k in chunk])
            pipe.zrem(self._k("live"), *chunk)
            removed += int((await pipe.execute())[0])
        return removed

    async def _must(self, op: Callable[[], Awaitable[T]]) -> T:
        try:
            return await self._redis(op)
        except RedisDown as exc:
            raise Unavailable(
                "the cache store (Redis) is unreachable", reason="CACHE_DEGRADED", retry_after=1.0
            ) from exc

    async def _qdrant_cleanup(self, fn: Callable[..., None], *args: Any) -> None:
        if self.qdrant is None or self.embedder is None:
            return
        try:
            await self.qdrant.run(fn, *args)
        except Exception as exc:  # the Redis entries are gone: orphan points are misses anyway
            log.warning("semantic index cleanup failed: %s", exc)

    # ----- stats and housekeeping

    async def stats(self) -> Stats:
        out = Stats(**{**self.counts.__dict__, "rejections_by_reason": dict(self.counts.rejections_by_reason)})

        async def count() -> int:
            live = self._k("live")
            pipe = self.redis.pipeline(transaction=False)
            pipe.zremrangebyscore(live, "-inf", time.time())
            pipe.zcard(live)
            return int((await pipe.execute())[1])

        try:
            out.entries = await self._redis(count)
        except (RedisDown, redis_errors.RedisError):
            out.entries = 0
        out.degraded = self.degraded
        return out

    async def _sweep_loop(self) -> None:
        """Deletes semantic points of expired entries (those never met by a lookup)."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await self.qdrant.run(self._sweep_expired)  # type: ignore[union-attr]
            except Exception as exc:
                log.warning("semantic index sweep failed: %s", exc)

    def _sweep_expired(self) -> None:
        assert self.qdrant is not None
        flt = qm.Filter(must=[qm.FieldCondition(key="expires_at", range=qm.Range(lt=time.time()))])
        self.qdrant.client.delete(self.collection, points_selector=qm.FilterSelector(filter=flt))
