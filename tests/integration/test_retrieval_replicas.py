"""Two retrieval replicas (two processes) ingesting into one collection at once: every replica
agrees on the collection's version, two ingests always give two distinct versions, and no answer
cached before an ingest is served once it has returned, whatever version a gateway still trusts.

Each replica has its own embedded Qdrant here (an embedded store is one process's; with a Qdrant
server, LLMESH_TEST_QDRANT_URL, both share one); the versions live in the shared Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis

from llmesh import collection_versions
from llmesh.supervisor import Mesh as Processes
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

pytestmark = pytest.mark.timeout(600)

COLLECTION = "handbook"
QUESTION = "How many vacation days do employees get?"


def documents(days: int) -> list[common_pb2.Document]:
    text = f"Employees receive {days} days of paid vacation per year, approved by their manager."
    return [common_pb2.Document(id="vacation", text=text)]


async def ingest(stub: retrieval_pb2_grpc.RetrievalStub, tenant: str, days: int) -> int:
    request = retrieval_pb2.UpsertRequest(collection=COLLECTION, tenant=tenant, documents=documents(days))
    progress = [p async for p in stub.Upsert(request, timeout=120)]
    assert progress[-1].done
    return progress[-1].collection_version


@pytest.fixture
async def replicas(
    models_dir: Path, tiny_model: Path, tmp_path: Path, qdrant_env: dict[str, str], redis_url: str
) -> AsyncIterator[tuple[list[retrieval_pb2_grpc.RetrievalStub], gateway_pb2_grpc.GatewayStub, str, object]]:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    prefix = f"llmesh-replicas:{uuid.uuid4().hex[:8]}:"
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path / "mesh"),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": redis_url,
        "LLMESH_LOG_LEVEL": "WARNING",
        **qdrant_env,
    }
    processes = Processes(env=env, services=())
    try:
        async with (
            hosted("tokenizer", TokenizerApp, env) as tok,
            hosted("inference", InferenceApp, env) as inf,
            hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as cache,
        ):
            started = [
                await asyncio.to_thread(
                    processes.start_one,
                    f"retrieval-{name}",
                    180.0,
                    {"LLMESH_DATA_DIR": str(tmp_path / name), "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}"},
                    "retrieval",
                )
                for name in ("a", "b")
            ]
            gateway_env = {
                **env,
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                # Both replicas behind one target, round robin.
                "LLMESH_RETRIEVAL_TARGET": "ipv4:" + ",".join(p.target for p in started),
                # The gateway trusts a learned version for ten minutes: only the cache's own check
                # of the current version can keep a stale answer from serving.
                "LLMESH_COLLECTION_VERSION_TTL_SECONDS": "600",
                "LLMESH_MIN_CONTEXT_SCORE": "0",
            }
            async with hosted("gateway", GatewayApp, gateway_env) as gw:
                channels = [grpc.aio.insecure_channel(p.target) for p in started]
                try:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                        stubs = [retrieval_pb2_grpc.RetrievalStub(c) for c in channels]
                        yield stubs, gateway_pb2_grpc.GatewayStub(channel), tenant, gw.app.gateway  # type: ignore[attr-defined]
                    await gw.app.gateway.settle()  # type: ignore[attr-defined]
                finally:
                    for c in channels:
                        await c.close()
    finally:
        await asyncio.to_thread(processes.stop)
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        client.delete(collection_versions.version_key(tenant, COLLECTION), *keys)


async def test_concurrent_ingests_on_two_replicas_give_distinct_versions_and_no_stale_answer(replicas) -> None:  # type: ignore[no-untyped-def]
    stubs, gateway, tenant, core = replicas
    for stub in stubs:  # both replicas hold the document
        await ingest(stub, tenant, 20)

    def ask() -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            prompt=QUESTION, tenant=tenant, collection=COLLECTION, sampling=common_pb2.SamplingParams(max_new_tokens=6)
        )

    first = await gateway.Generate(ask(), timeout=60)
    assert not first.cache.hit and first.sources
    await core.settle()  # the store runs in the background after the answer
    assert (await gateway.Generate(ask(), timeout=60)).cache.hit
    infos = [
        await s.GetCollectionInfo(retrieval_pb2.CollectionInfoRequest(collection=COLLECTION, tenant=tenant))
        for s in stubs
    ]
    before = infos[0].version
    assert [i.version for i in infos] == [before, before]  # the replicas agree

    versions = await asyncio.gather(ingest(stubs[0], tenant, 25), ingest(stubs[1], tenant, 30))
    assert versions[0] != versions[1] and min(versions) > before
    infos = [
        await s.GetCollectionInfo(retrieval_pb2.CollectionInfoRequest(collection=COLLECTION, tenant=tenant))
        for s in stubs
    ]
    assert [i.version for i in infos] == [max(versions)] * 2

    # Both ingests returned: the answer cached before them never serves again, on this gateway
    # (which still trusts the old version) or any other.
    after = await gateway.Generate(ask(), timeout=60)
    assert not after.cache.hit and after.sources
