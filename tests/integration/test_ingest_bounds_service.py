"""Ingest as a bounded, metered operation, on real servers in this process: the tokenizer,
retrieval (real MiniLM, embedded Qdrant in a temp folder, versions on the run's Redis) and the
gateway in front of them (inference and cache unreachable: ingest and search need neither).

Pathological chunk windows and documents that would make too many chunks are refused before any
work, on every service that can be called; a cancelled ingest stops embedding after the batch it
is in; two concurrent re-ingests of one document are serialised; and a key's request limit
applies to Ingest and Search as to Generate."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from qdrant_client import models as qm

from llmesh import keys_file
from llmesh.errors import status_details, unpack_details
from llmesh.testing import hosted
from llmesh.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.gateway.servicer import GatewayApp
from services.retrieval.core import RetrievalCore, physical_name
from services.retrieval.servicer import RetrievalApp
from services.tokenizer.servicer import TokenizerApp

pytestmark = pytest.mark.timeout(300)

CLOSED = "127.0.0.1:1"  # nothing listens there
# Chunks retrieval embeds at once here: a cancelled ingest's batches are small.
BATCH = 8
# The gateway's ingest budget here: the cancelled ingest's document is larger, so it runs alone.
BUDGET = 4096
MIB = 1024 * 1024
TENANT = "acme"
SENTENCE = "Employees receive twenty-five days of paid vacation per calendar year, approved by their manager. "
# The brief's bound: what one service hosting an ingest may grow by.
MAX_RSS_GROWTH_MB = 200


def prose(nbytes: int) -> str:
    return (SENTENCE * (nbytes // len(SENTENCE) + 1))[:nbytes]


def peak_rss_mb() -> float:
    """This process's peak resident memory (it hosts every service here), in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def violations(err: grpc.aio.AioRpcError) -> list[str]:
    details = unpack_details(status_details(err.trailing_metadata()))
    return [v.field for v in details["bad_request"].field_violations]  # type: ignore[attr-defined]


@dataclass
class Mesh:
    gateway: gateway_pb2_grpc.GatewayStub
    retrieval: retrieval_pb2_grpc.RetrievalStub
    tokenizer: tokenizer_pb2_grpc.TokenizerStub
    core: RetrievalCore
    gateway_app: GatewayApp
    keys: dict[str, str]


@pytest.fixture(scope="module")
async def mesh(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[Mesh]:
    folder = tmp_path_factory.mktemp("ingest-bounds")
    path = folder / "keys.json"
    _, open_key = keys_file.create(path, TENANT, name="open")
    limited, limited_key = keys_file.create(path, TENANT, rpm=2, name="limited")
    keys = {"open": open_key, "limited": limited_key, "limited_id": limited.id}
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(folder / "data"),
        "LLMESH_REDIS_URL": module_redis_url,
        "QDRANT_URL": "",
        "LLMESH_INGEST_BATCH_CHUNKS": str(BATCH),
    }
    async with hosted("tokenizer", TokenizerApp, env) as tok:
        env["LLMESH_TOKENIZER_TARGET"] = f"127.0.0.1:{tok.port}"
        async with hosted("retrieval", RetrievalApp, env) as ret:
            gateway_env = {
                **env,
                "LLMESH_RETRIEVAL_TARGET": f"127.0.0.1:{ret.port}",
                "LLMESH_INFERENCE_TARGET": CLOSED,
                "LLMESH_CACHE_TARGET": CLOSED,
                "LLMESH_API_KEYS_FILE": str(path),
                "LLMESH_INGEST_MAX_BYTES_IN_FLIGHT": str(BUDGET),
            }
            async with (
                hosted("gateway", GatewayApp, gateway_env) as gw,
                grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to_gateway,
                grpc.aio.insecure_channel(f"127.0.0.1:{ret.port}") as to_retrieval,
                grpc.aio.insecure_channel(f"127.0.0.1:{tok.port}") as to_tokenizer,
            ):
                yield Mesh(
                    gateway_pb2_grpc.GatewayStub(to_gateway),
                    retrieval_pb2_grpc.RetrievalStub(to_retrieval),
                    tokenizer_pb2_grpc.TokenizerStub(to_tokenizer),
                    ret.app.core.get(),  # type: ignore[attr-defined]
                    gw.app,  # type: ignore[arg-type]
                    keys,
                )


def ingest_request(
    collection: str, documents: Sequence[tuple[str, str]], chunk_tokens: int = 0, overlap_tokens: int = 0
) -> gateway_pb2.IngestRequest:
    return gateway_pb2.IngestRequest(
        collection=collection,
        tenant=TENANT,
        documents=[common_pb2.Document(id=i, text=t) for i, t in documents],
        chunk_tokens=chunk_tokens,
        overlap_tokens=overlap_tokens,
    )


async def upsert(
    stub: retrieval_pb2_grpc.RetrievalStub, collection: str, documents: Sequence[tuple[str, str]], **window: int
) -> list[retrieval_pb2.UpsertProgress]:
    request = retrieval_pb2.UpsertRequest(
        collection=collection,
        tenant=TENANT,
        documents=[common_pb2.Document(id=i, text=t) for i, t in documents],
        **window,
    )
    return [p async for p in stub.Upsert(request, timeout=60)]


async def test_pathological_windows_are_refused_naming_the_field_on_every_service(mesh: Mesh) -> None:
    # A 1 MiB document (about 230k tokens): at chunk_tokens=1 some 230k chunks to embed; at
    # 8192/8191 some 220k windows of 8192 tokens (gigabytes) built in the tokenizer. Each is
    # refused before any work, by the gateway and by retrieval and the tokenizer called directly.
    collection = f"windows-{uuid.uuid4().hex[:6]}"
    text = prose(MIB)
    before = peak_rss_mb()
    for chunk_tokens, overlap_tokens, field in (
        (1, 0, "chunk_tokens"),
        (8192, 8191, "chunk_tokens"),
        (15, 0, "chunk_tokens"),
        (2049, 0, "chunk_tokens"),
        (64, 33, "overlap_tokens"),
        (0, 1025, "overlap_tokens"),  # the default window: no overlap past half of the largest
    ):
        window = {"chunk_tokens": chunk_tokens, "overlap_tokens": overlap_tokens}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await mesh.gateway.Ingest(
                ingest_request(collection, [("big", text)], **window), metadata=bearer(mesh.keys["open"]), timeout=30
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, window
        assert violations(refused.value) == [field], window
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(upsert(mesh.retrieval, collection, [("big", text)], **window), 30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, window
        assert violations(refused.value) == [field], window
        if chunk_tokens:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                chunk_request = tokenizer_pb2.ChunkRequest(
                    text=text, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens
                )
                await mesh.tokenizer.Chunk(chunk_request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, window
            assert violations(refused.value) == [field], window
    assert peak_rss_mb() - before <= MAX_RSS_GROWTH_MB
    found = await mesh.retrieval.GetCollectionInfo(
        retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=TENANT)
    )
    assert not found.exists


async def test_a_document_past_the_most_chunks_is_refused_before_anything_is_written(mesh: Mesh) -> None:
    # Digits are a token each: 80 KB of them at a 16-token window every 8 tokens is about 10,000
    # chunks, past the default 8,192 per document.
    collection = f"too-many-{uuid.uuid4().hex[:6]}"
    digits = ("0123456789" * 8200)[:82_000]
    request = ingest_request(collection, [("fine", SENTENCE), ("digits", digits)], chunk_tokens=16, overlap_tokens=8)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await mesh.gateway.Ingest(request, metadata=bearer(mesh.keys["open"]), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(refused.value) == ["documents[1].text"]
    assert "at most 8192" in (refused.value.details() or "")
    found = await mesh.retrieval.GetCollectionInfo(
        retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=TENANT)
    )
    assert not found.exists  # not even the first document
    # The tokenizer on its own refuses by the same count, and a caller may ask for fewer.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await mesh.tokenizer.Chunk(
            tokenizer_pb2.ChunkRequest(text=digits, chunk_tokens=16, overlap_tokens=8), timeout=30
        )
    assert violations(refused.value) == ["text"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await mesh.tokenizer.Chunk(
            tokenizer_pb2.ChunkRequest(text=prose(2000), chunk_tokens=16, max_chunks=3), timeout=30
        )
    assert violations(refused.value) == ["text"]


@dataclass
class HeldEmbedding:
    """Retrieval's embedding thread, counted and held at its first pass."""

    embedded: list[int]  # texts per encoding pass
    first_pass: threading.Event
    release: threading.Event
    cancelled: asyncio.Event  # an ingest's embedding call was cancelled


@contextlib.asynccontextmanager
async def held_embedding(core: RetrievalCore) -> AsyncIterator[HeldEmbedding]:
    embedder = core.embedder
    real_encode, real_aencode = embedder.encode, embedder.aencode
    held = HeldEmbedding([], threading.Event(), threading.Event(), asyncio.Event())

    def encode(texts: Sequence[str]) -> Any:
        held.embedded.append(len(texts))
        if len(held.embedded) == 1:
            held.first_pass.set()
            held.release.wait(60)
        return real_encode(texts)

    async def aencode(texts: Sequence[str]) -> Any:
        try:
            return await real_aencode(texts)
        except asyncio.CancelledError:
            held.cancelled.set()
            raise

    embedder.encode = encode  # type: ignore[method-assign]
    embedder.aencode = aencode  # type: ignore[method-assign]
    try:
        yield held
    finally:
        held.release.set()
        del embedder.encode, embedder.aencode
    # A pass queued now runs after every pass queued before it: the ingests' last one has ended.
    await real_aencode(["probe"])


async def test_a_cancelled_ingest_stops_embedding_after_its_current_batch(mesh: Mesh) -> None:
    collection = f"cancelled-{uuid.uuid4().hex[:6]}"
    text = prose(6000)  # about 1,300 tokens: some 80 chunks of 16, ten batches of BATCH
    async with held_embedding(mesh.core) as held:
        call = mesh.gateway.Ingest(
            ingest_request(collection, [("handbook", text)], chunk_tokens=16),
            metadata=bearer(mesh.keys["open"]),
            timeout=120,
        )
        assert await asyncio.to_thread(held.first_pass.wait, 60)
        call.cancel()
        await asyncio.wait_for(held.cancelled.wait(), 60)  # retrieval's ingest saw the cancellation
    assert held.embedded == [BATCH], f"texts embedded per pass after the cancel: {held.embedded}"
    assert mesh.gateway_app.gateway.ingests.in_flight == 0
    # Nothing of it holds the document: the same document ingests again at once.
    again = await mesh.gateway.Ingest(
        ingest_request(collection, [("handbook", SENTENCE)]), metadata=bearer(mesh.keys["open"]), timeout=60
    )
    assert again.documents == 1 and again.chunks == 1 and len(mesh.core.documents) == 0


async def test_an_ingest_past_the_gateways_budget_is_refused_with_a_retry_delay(mesh: Mesh) -> None:
    collection = f"budget-{uuid.uuid4().hex[:6]}"
    big = prose(BUDGET + 1000)  # more than the whole budget: admitted alone
    async with held_embedding(mesh.core) as held:
        running = asyncio.ensure_future(
            mesh.gateway.Ingest(
                ingest_request(collection, [("big", big)]), metadata=bearer(mesh.keys["open"]), timeout=120
            )
        )
        assert await asyncio.to_thread(held.first_pass.wait, 60)
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await mesh.gateway.Ingest(
                ingest_request(collection, [("small", SENTENCE)]), metadata=bearer(mesh.keys["open"]), timeout=30
            )
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = unpack_details(status_details(busy.value.trailing_metadata()))
        assert info["error_info"].reason == "INGEST_BUSY"  # type: ignore[attr-defined]
        assert info["retry_info"].retry_delay.seconds >= 1  # type: ignore[attr-defined]
        assert mesh.gateway_app.gateway.ingests.in_flight == BUDGET
    assert (await running).documents == 1
    assert mesh.gateway_app.gateway.ingests.in_flight == 0
    small = await mesh.gateway.Ingest(
        ingest_request(collection, [("small", SENTENCE)]), metadata=bearer(mesh.keys["open"]), timeout=60
    )
    assert small.documents == 1


def _keeps_only(selector: Any, ingest: str) -> bool:
    """A stale-chunk delete: everything of the documents except what `ingest` wrote."""
    if not isinstance(selector, qm.FilterSelector):
        return False
    return any(
        isinstance(c, qm.FieldCondition) and c.key == "ingest" and getattr(c.match, "value", None) == ingest
        for c in selector.filter.must_not or []
    )


async def test_two_concurrent_reingests_of_one_document_leave_the_last_acknowledged_searchable(mesh: Mesh) -> None:
    # The interleaving that lost the document: the first ingest writes its chunks; the second
    # overwrites them (same point ids); the first's stale-chunk delete then removes the second's
    # chunks as stale. Forced here: the first ingest's delete waits until the second has written
    # or is waiting its turn.
    collection = f"race-{uuid.uuid4().hex[:6]}"
    physical = physical_name(TENANT, collection)

    def version(digit: str, into: str = collection) -> Any:  # one number apart: the same chunk count
        text = f"Travel policy revision {digit * 4}. " + prose(400)
        return upsert(mesh.retrieval, into, [("policy", text)], chunk_tokens=24, overlap_tokens=4)

    await version("0")
    client = mesh.core.qdrant.client
    real_upsert, real_delete = client.upsert, client.delete
    first_ingest: list[str] = []
    first_wrote = threading.Event()
    second_went = threading.Event()

    def upsert_points(collection_name: str, points: Sequence[qm.PointStruct], wait: bool = True) -> None:
        real_upsert(collection_name, points=points, wait=wait)
        if collection_name != physical or not points:
            return
        ingest = (points[0].payload or {})["ingest"]
        if not first_ingest:
            first_ingest.append(ingest)
            first_wrote.set()
        elif ingest != first_ingest[0]:
            second_went.set()

    def delete(collection_name: str, points_selector: Any, wait: bool = True) -> None:
        if collection_name == physical and first_ingest and _keeps_only(points_selector, first_ingest[0]):
            second_went.wait(60)
        real_delete(collection_name, points_selector=points_selector, wait=wait)

    acknowledged: list[str] = []

    async def reingest(name: str, digit: str) -> None:
        progress = await version(digit)
        assert progress[-1].done
        acknowledged.append(name)

    client.upsert, client.delete = upsert_points, delete  # type: ignore[method-assign]
    waited: list[tuple[str, str]] = []

    def on_document_wait(physical: str, document_id: str) -> None:
        waited.append((physical, document_id))
        second_went.set()

    mesh.core.on_document_wait = on_document_wait
    try:
        first = asyncio.create_task(reingest("first", "1"))
        assert await asyncio.to_thread(first_wrote.wait, 60)
        second = asyncio.create_task(reingest("second", "2"))
        await asyncio.gather(first, second)
    finally:
        second_went.set()
        del client.upsert, client.delete
        mesh.core.on_document_wait = None
    found = await mesh.retrieval.Search(
        retrieval_pb2.RetrievalSearchRequest(
            query="travel policy revision", collection=collection, tenant=TENANT, top_k=50
        )
    )
    texts = [r.text for r in found.results if r.document_id == "policy"]
    assert texts, "the document is gone from search"
    assert any("2222" in t for t in texts) and not any("1111" in t or "0000" in t for t in texts)
    assert acknowledged == ["first", "second"] and waited == [(physical, "policy")]
    # Exactly the second version's chunks: the same text ingested alone elsewhere makes as many.
    alone = (await version("2", f"{collection}-alone"))[-1]
    about = retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=TENANT)
    assert (await mesh.retrieval.GetCollectionInfo(about)).points == alone.chunks_done


async def test_ingest_and_search_past_a_keys_request_limit_are_refused_with_a_retry_delay(mesh: Mesh) -> None:
    collection = f"limited-{uuid.uuid4().hex[:6]}"
    limited = bearer(mesh.keys["limited"])
    done = [
        await mesh.gateway.Ingest(ingest_request(collection, [(f"doc{i}", SENTENCE)]), metadata=limited, timeout=60)
        for i in range(2)
    ]
    for call in (
        mesh.gateway.Ingest(ingest_request(collection, [("doc2", SENTENCE)]), metadata=limited, timeout=60),
        mesh.gateway.Search(
            gateway_pb2.SearchRequest(query="vacation", collection=collection, tenant=TENANT),
            metadata=limited,
            timeout=60,
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 requests per minute" in (refused.value.details() or "")
        info = unpack_details(status_details(refused.value.trailing_metadata()))
        assert info["error_info"].reason == "KEY_RPM_EXCEEDED"  # type: ignore[attr-defined]
        assert info["error_info"].metadata["key_id"] == mesh.keys["limited_id"]  # type: ignore[attr-defined]
        delay = info["retry_info"].retry_delay  # type: ignore[attr-defined]
        assert 0 < delay.seconds + delay.nanos / 1e9 <= 60
    # Another key of the tenant is not limited by it.
    found = await mesh.gateway.Search(
        gateway_pb2.SearchRequest(query="vacation", collection=collection, tenant=TENANT),
        metadata=bearer(mesh.keys["open"]),
        timeout=60,
    )
    assert {r.document_id for r in found.results} == {"doc0", "doc1"}
    # Metered: each ingest reports its documents' tokens (what the key's token limits count).
    counted = await mesh.tokenizer.Count(tokenizer_pb2.CountRequest(texts=[SENTENCE]), timeout=30)
    assert [d.document_tokens for d in done] == [counted.total] * 2
