"""The answer cache never serves an answer made for a different request: through the real gateway
(gRPC and the OpenAI HTTP API) on real servers (tokenizer, tiny-model inference, the cache on
real Redis with its semantic tier), with a retrieval whose search can be made to fail, hang or
refuse a long query on demand."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest
import redis

from llmesh import collection_versions
from llmesh.server import ServiceHost
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

MODEL = "tiny-random-llama-0"
VERSION = 5
# What retrieval refuses (RetrievalSearchRequest.query); the gateway accepts twice as much.
MAX_QUERY_BYTES = 16 * 1024
ADMIN_KEY = "admin-key-for-the-purge-tests-0123"


@dataclass
class FakeRetrieval(retrieval_pb2_grpc.RetrievalServicer):
    """A collection with chunks at VERSION; Search answers, fails, hangs, and refuses a query
    over 16 KiB as the real service does."""

    mode: str = "ok"
    searches: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def GetCollectionInfo(self, request, context):  # type: ignore[no-untyped-def]
        return retrieval_pb2.CollectionInfo(exists=True, points=3, version=VERSION, dimension=384)

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        self.searches += 1
        if len(request.query.encode()) > MAX_QUERY_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"query: longer than {MAX_QUERY_BYTES} bytes")
        if self.mode == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake search failure")
        if self.mode == "hang":
            await self.release.wait()
        chunk = common_pb2.ScoredChunk(document_id="handbook", text="Employees get 25 vacation days.", score=0.9)
        return retrieval_pb2.RetrievalSearchResponse(results=[chunk], collection_version=VERSION)


@dataclass
class Mesh:
    gateway: ServiceHost
    stub: gateway_pb2_grpc.GatewayStub
    retrieval: FakeRetrieval
    redis_url: str

    async def settle(self) -> None:
        await self.gateway.app.gateway.settle()  # type: ignore[attr-defined]

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.app.http.port}/v1"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def mesh(
    models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[Mesh]:
    prefix = f"llmesh-trust:{uuid.uuid4().hex[:8]}:"
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("trust-data")),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": module_redis_url,
        "LLMESH_CACHE_INVALIDATORS": "*",  # plaintext mesh: no identities (their own test is over mTLS)
        "QDRANT_URL": "",
    }
    fake = FakeRetrieval()
    server = grpc.aio.server()
    retrieval_pb2_grpc.add_RetrievalServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with (
            hosted("tokenizer", TokenizerApp, env) as tok,
            hosted("inference", InferenceApp, env) as inf,
            hosted("cache", lambda s: CacheApp(s, key_prefix=prefix), env) as cache,
        ):
            gateway_env = {
                **env,
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": f"127.0.0.1:{port}",
                "LLMESH_HOP_SEARCH_SECONDS": "0.3",
                "LLMESH_MAX_PROMPT_TOKENS": "1500",
                "LLMESH_ADMIN_KEYS": ADMIN_KEY,
            }
            async with hosted("gateway", GatewayApp, gateway_env) as gw:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                    yield Mesh(gw, gateway_pb2_grpc.GatewayStub(channel), fake, module_redis_url)
                fake.release.set()
    finally:
        fake.release.set()
        await server.stop(grace=0.5)


def tenant_with_collection(mesh: Mesh) -> str:
    """A fresh tenant whose collection "docs" is at VERSION, as retrieval would have set it."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    redis.Redis.from_url(mesh.redis_url).set(collection_versions.version_key(tenant, "docs"), VERSION, ex=600)
    return tenant


def ask(prompt: str, tenant: str, **kw: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, tenant=tenant, collection="docs", sampling=common_pb2.SamplingParams(max_new_tokens=6), **kw
    )


async def test_two_system_prompts_never_share_an_answer_through_the_openai_api(mesh: Mesh) -> None:
    question = f"What is {uuid.uuid4().hex[:6]} plus two?"
    async with openai.AsyncOpenAI(base_url=mesh.http_base, api_key="unused", max_retries=0, timeout=60) as client:

        async def chat(system: str) -> dict:
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                max_tokens=6,
                extra_body={"llmesh": {"use_retrieval": False}},
            )
            return answer.model_extra["llmesh"]  # type: ignore[index]

        assert not (await chat("Answer in French."))["cache"]["hit"]
        await mesh.settle()
        # The same question under another system prompt: neither tier may answer it.
        assert not (await chat("Answer with a number only."))["cache"]["hit"]
        await mesh.settle()
        # Each is still its own entry.
        assert (await chat("Answer in French."))["cache"]["tier"] == "exact"
        assert (await chat("Answer with a number only."))["cache"]["tier"] == "exact"


@pytest.mark.parametrize("failure", ["fail", "hang"])
async def test_an_answer_made_without_its_search_is_never_stored_under_the_rag_scope(mesh: Mesh, failure: str) -> None:
    tenant = tenant_with_collection(mesh)
    question = f"How many vacation days do I get ({failure})?"
    mesh.retrieval.mode = failure
    mesh.retrieval.release.clear()
    try:
        first = await mesh.stub.Generate(ask(question, tenant), timeout=60)
        assert "retrieval_unavailable" in first.degradations and not first.sources and not first.cache.hit
        await mesh.settle()
        # Asked again while the search still fails: the answer made without context serves, and
        # says it lacks retrieval.
        again = await mesh.stub.Generate(ask(question, tenant), timeout=60)
        assert again.cache.hit and again.text == first.text
        assert "retrieval_unavailable" in again.degradations and not again.sources
    finally:
        mesh.retrieval.mode = "ok"
        mesh.retrieval.release.set()
    # The search is back: the RAG scope never held that answer, so this one is grounded.
    grounded = await mesh.stub.Generate(ask(question, tenant), timeout=60)
    assert not grounded.cache.hit and [s.document_id for s in grounded.sources] == ["handbook"]
    assert "retrieval_unavailable" not in grounded.degradations
    await mesh.settle()
    assert (await mesh.stub.Generate(ask(question, tenant), timeout=60)).sources[0].document_id == "handbook"


async def test_a_question_too_long_to_search_is_answered_and_cached_without_context_and_says_so(mesh: Mesh) -> None:
    tenant = tenant_with_collection(mesh)
    question = "What does the handbook say about the log below?\n" + "-" * 18_000 + "\nQuote it."
    before = mesh.retrieval.searches
    first = await mesh.stub.Generate(ask(question, tenant), timeout=60)
    assert "retrieval_query_too_long" in first.degradations and not first.sources
    await mesh.settle()
    again = await mesh.stub.Generate(ask(question, tenant), timeout=60)
    assert again.cache.hit and "retrieval_query_too_long" in again.degradations and not again.sources
    assert mesh.retrieval.searches == before  # never sent a search retrieval would refuse
    # The same question short enough to search is grounded: the long one's answer is not under the RAG scope.
    short = await mesh.stub.Generate(ask("What does the handbook say about the log below?", tenant), timeout=60)
    assert not short.cache.hit and short.sources


async def test_a_purge_through_the_gateway_needs_an_admin_key_and_clears_one_tenant(mesh: Mesh) -> None:
    a, b = tenant_with_collection(mesh), tenant_with_collection(mesh)
    question = "What is the refund window?"
    for tenant in (a, b):
        await mesh.stub.Generate(ask(question, tenant, use_retrieval=False), timeout=60)
    await mesh.settle()
    purge = gateway_pb2.PurgeCacheRequest(tenant=a)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.PurgeCache(purge, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.PurgeCache(purge, timeout=10, metadata=(("authorization", "Bearer not-the-admin-key-0000"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    admin = (("authorization", f"Bearer {ADMIN_KEY}"),)
    # One model's answers (a name ListModels shows), then everything of the tenant.
    assert (
        await mesh.stub.PurgeCache(gateway_pb2.PurgeCacheRequest(tenant=a, model=MODEL), metadata=admin)
    ).removed == 1
    assert not (await mesh.stub.Generate(ask(question, a, use_retrieval=False), timeout=60)).cache.hit
    await mesh.settle()
    assert (await mesh.stub.PurgeCache(purge, timeout=10, metadata=admin)).removed == 1
    assert not (await mesh.stub.Generate(ask(question, a, use_retrieval=False), timeout=60)).cache.hit
    assert (await mesh.stub.Generate(ask(question, b, use_retrieval=False), timeout=60)).cache.hit  # untouched
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.PurgeCache(gateway_pb2.PurgeCacheRequest(), metadata=admin)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
