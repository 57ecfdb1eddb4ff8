"""gRPC side of the cache service: messages in, CacheCore calls, messages out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from llmesh import collection_versions, redis_server
from llmesh import qdrant as qdrant_mod
from llmesh.embeddings import Embedder
from llmesh.errors import InvalidArgument, PermissionDenied
from llmesh.server import Readiness
from llmesh.settings import CacheServiceSettings
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.core import DEFAULT_PREFIX, CacheCore, LookupQuery, LookupResult, redis_client
from services.cache.keys import Scope

log = logging.getLogger("llmesh.cache")

MAX_BATCH = 256
TIERS = {"exact": common_pb2.CACHE_TIER_EXACT, "semantic": common_pb2.CACHE_TIER_SEMANTIC}


def scope_of(msg: cache_pb2.CacheScope) -> Scope:
    return Scope.of(msg)


ANY_CALLER = "*"


def caller_identities(context: grpc.aio.ServicerContext) -> list[str]:
    """The names the caller's client certificate was verified for (its common name and DNS
    names); empty without mutual TLS."""
    if not context.peer_identities():
        return []
    auth = context.auth_context()
    names = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, core: Readiness[CacheCore], invalidators: Sequence[str] = ("gateway",)) -> None:
        self._core = core
        # Mesh identities (certificate names) allowed to call Invalidate; "*": any caller.
        self.invalidators = frozenset(invalidators)

    @property
    def core(self) -> CacheCore:
        return self._core.get()

    async def Lookup(self, request, context):  # type: ignore[no-untyped-def]
        result = await self.core.lookup(request.prompt, scope_of(request.scope), request.allow_semantic)
        return self._response(result)

    async def LookupBatch(self, request, context):  # type: ignore[no-untyped-def]
        if not request.requests:
            raise InvalidArgument([("requests", "at least one lookup")])
        if len(request.requests) > MAX_BATCH:
            raise InvalidArgument([("requests", f"at most {MAX_BATCH} lookups")])
        queries = [LookupQuery(r.prompt, scope_of(r.scope), r.allow_semantic) for r in request.requests]
        results = await self.core.lookup_many(queries)
        return cache_pb2.CacheLookupBatchResponse(results=[self._response(r) for r in results])

    def _response(self, result: LookupResult) -> cache_pb2.CacheLookupResponse:
        response = cache_pb2.CacheLookupResponse(
            hit=result.hit,
            tier=TIERS.get(result.tier, common_pb2.CACHE_TIER_UNSPECIFIED),
            similarity=result.similarity,
            key=result.key,
            degraded=result.degraded or self.core.degraded,
            collection_version=result.collection_version,
        )
        if result.hit:
            response.answer.ParseFromString(result.answer)
        return response

    async def Store(self, request, context):  # type: ignore[no-untyped-def]
        answer = request.answer
        violations = []
        if not answer.text:
            violations.append(("answer.text", "an empty answer is not cached"))
        if answer.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
            violations.append(("answer.finish_reason", "a cancelled generation is not cached"))
        if violations:
            raise InvalidArgument(violations)
        result = await self.core.store(
            request.prompt, scope_of(request.scope), answer.SerializeToString(deterministic=True), request.ttl_seconds
        )
        return cache_pb2.CacheStoreResponse(key=result.key, stored=result.stored)

    def _authorize_invalidate(self, context: grpc.aio.ServicerContext) -> None:
        if ANY_CALLER in self.invalidators:
            return
        names = caller_identities(context)
        if not names:
            raise PermissionDenied(
                "Invalidate needs the mesh identity: call it over mutual TLS with the gateway's certificate "
                "(a mesh without TLS allows it only with LLMESH_CACHE_INVALIDATORS=*)",
                reason="MESH_IDENTITY_REQUIRED",
            )
        if not self.invalidators.intersection(names):
            raise PermissionDenied(
                f"certificate {names[0]!r} may not invalidate cached answers "
                f"(LLMESH_CACHE_INVALIDATORS: {', '.join(sorted(self.invalidators))})",
                reason="MESH_IDENTITY_NOT_ALLOWED",
            )

    async def Invalidate(self, request, context):  # type: ignore[no-untyped-def]
        self._authorize_invalidate(context)
        if not request.tenant:
            raise InvalidArgument([("tenant", "required: entries are removed one tenant at a time")])
        target = request.WhichOneof("target")
        if target == "key":
            removed = await self.core.invalidate_key(request.tenant, request.key)
        elif target == "collection":
            removed = await self.core.invalidate_collection(request.tenant, request.collection)
        elif target == "model":
            if not request.model:
                raise InvalidArgument([("model", "must not be empty")])
            removed = await self.core.invalidate_model(request.tenant, request.model)
        elif target == "all" and request.all:
            removed = await self.core.invalidate_tenant(request.tenant)
        else:
            raise InvalidArgument([("target", "set one of key, collection, model or all")])
        return cache_pb2.InvalidateResponse(removed=removed)

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        stats = await self.core.stats()
        return cache_pb2.CacheStatsResponse(
            entries=stats.entries,
            exact_hits=stats.exact_hits,
            semantic_hits=stats.semantic_hits,
            misses=stats.misses,
            rejections=stats.rejections,
            degraded=stats.degraded,
        )


class CacheApp:
    service_names: Sequence[str] = (cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name,)

    def __init__(
        self,
        settings: CacheServiceSettings,
        *,
        key_prefix: str = DEFAULT_PREFIX,
        semantic: bool = True,
        version_prefix: str = collection_versions.PREFIX,
    ) -> None:
        """`key_prefix`, `version_prefix`: where entries and collection versions live in Redis
        (tests keep theirs apart)."""
        self.settings = settings
        self.key_prefix = key_prefix
        self.version_prefix = version_prefix
        self.semantic = semantic
        self.core: Readiness[CacheCore] = Readiness()
        self._embedder: Embedder | None = None
        self._qdrant: qdrant_mod.QdrantHandle | None = None

    def register(self, server: grpc.aio.Server) -> None:
        invalidators = [name.strip() for name in self.settings.cache.invalidators.split(",") if name.strip()]
        cache_pb2_grpc.add_CacheServicer_to_server(CacheServicer(self.core, invalidators), server)

    async def start(self) -> None:
        s = self.settings
        if self.semantic:
            self._embedder = await asyncio.to_thread(
                Embedder.load, s.runtime.models_path, s.store.embedding_model, dtype=s.store.embedding_dtype
            )
            await self._embedder.aencode(["warm up"])
            self._qdrant = await asyncio.to_thread(qdrant_mod.open_client, s, "cache")
        if not s.store.redis_url:
            url = redis_server.redacted(redis_server.embedded_url(s))
            log.info("using the embedded Redis at %s (started by `llmesh up`)", url)
        core = CacheCore(
            redis_client(redis_server.resolve_url(s.store.redis_url, s), s.store.redis_timeout_seconds),
            embedder=self._embedder,
            qdrant=self._qdrant,
            threshold=s.cache.semantic_threshold,
            default_ttl=s.cache.ttl_seconds,
            timeout=s.store.redis_timeout_seconds,
            default_collection=s.collections.default_collection,
            prefix=self.key_prefix,
            version_prefix=self.version_prefix,
        )
        await core.start()
        self.core.set(core)

    def health_details(self) -> dict[str, bool]:
        """`llmesh.v1.Cache/redis` in the health service: NOT_SERVING while Redis is unreachable
        (the cache itself stays SERVING, answering miss); `llmesh.v1.Cache/qdrant` likewise for
        the semantic tier's Qdrant, as seen by its last call."""
        details = {"redis": self.core.ready and not self.core.get().degraded}
        if self._qdrant is not None:
            details["qdrant"] = self._qdrant.reachable
        return details

    async def stop(self) -> None:
        if self.core.ready:
            await self.core.get().close()
            self.core.clear()
        if self._qdrant is not None:
            await asyncio.to_thread(self._qdrant.close)
        if self._embedder is not None:
            self._embedder.close()
