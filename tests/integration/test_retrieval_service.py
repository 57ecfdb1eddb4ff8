"""The retrieval service in-process with the real tokenizer service, real MiniLM and embedded
Qdrant in a temp folder."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from llmesh.errors import status_details, unpack_details
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, retrieval_pb2, retrieval_pb2_grpc
from services.retrieval.servicer import RetrievalApp
from services.tokenizer.servicer import TokenizerApp

MAX_DOC_BYTES = 8192
# Collection versions of this run, apart from every other run's.
VERSIONS = f"llmesh-test-versions:{uuid.uuid4().hex[:12]}:"

HANDBOOK = {
    "vacation": (
        "Employees receive twenty-five days of paid vacation per calendar year. Unused vacation days can be "
        "carried over to the next year, up to a maximum of five days. Vacation requests must be approved by "
        "your manager at least two weeks in advance through the HR portal."
    ),
    "expenses": (
        "Business travel expenses are reimbursed within thirty days. Keep every receipt and submit the expense "
        "report through the finance tool. Meals are covered up to sixty euros per day when travelling abroad."
    ),
    "security": (
        "Laptops must use full-disk encryption and a screen lock after five minutes of inactivity. Report lost "
        "devices to the security team immediately. Never share your password or two-factor codes with anyone."
    ),
    "onboarding": (
        "New hires meet their onboarding buddy on the first day. The first week covers tooling setup, the code "
        "review process and an introduction to the on-call rotation."
    ),
}


@contextlib.asynccontextmanager
async def retrieval_service(
    models_dir: Path, data_dir: Path, redis_url: str, qdrant: dict[str, str] | None = None, versions: str = VERSIONS
) -> AsyncIterator[retrieval_pb2_grpc.RetrievalStub]:
    """`redis_url`: the test's own Redis database (the `redis_url` fixtures), where versions live."""
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(data_dir),
        "LLMESH_REDIS_URL": redis_url,
        "QDRANT_URL": "",
        **(qdrant or {}),
    }
    async with hosted("tokenizer", TokenizerApp, env) as tok:
        env = {
            **env,
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_MAX_DOCUMENT_BYTES": str(MAX_DOC_BYTES),
        }
        async with hosted("retrieval", lambda s: RetrievalApp(s, version_prefix=versions), env) as host:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
                yield retrieval_pb2_grpc.RetrievalStub(channel)


@pytest.fixture(scope="module")
async def rag(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, qdrant_env: dict[str, str], module_redis_url: str
) -> AsyncIterator[retrieval_pb2_grpc.RetrievalStub]:
    data_dir = tmp_path_factory.mktemp("retrieval-data")
    async with retrieval_service(models_dir, data_dir, module_redis_url, qdrant_env) as stub:
        yield stub


def _docs(**overrides: str) -> list[common_pb2.Document]:
    texts = {**HANDBOOK, **overrides}
    return [
        common_pb2.Document(id=name, text=text, metadata={"topic": name, "lang": "en"}) for name, text in texts.items()
    ]


async def upsert(stub, collection: str, docs, tenant: str = "acme", chunk_tokens: int = 24, overlap: int = 4):  # type: ignore[no-untyped-def]
    request = retrieval_pb2.UpsertRequest(
        collection=collection, tenant=tenant, documents=docs, chunk_tokens=chunk_tokens, overlap_tokens=overlap
    )
    return [p async for p in stub.Upsert(request, timeout=60)]


async def info(stub, collection: str, tenant: str = "acme") -> retrieval_pb2.CollectionInfo:  # type: ignore[no-untyped-def]
    return await stub.GetCollectionInfo(retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=tenant))


def _violations(err: grpc.aio.AioRpcError) -> list[str]:
    details = unpack_details(status_details(err.trailing_metadata()))
    return [v.field for v in details["bad_request"].field_violations]


async def test_upsert_streams_progress_and_search_finds_the_right_chunk(rag) -> None:  # type: ignore[no-untyped-def]
    coll = f"handbook-{uuid.uuid4().hex[:6]}"
    progress = await upsert(rag, coll, _docs())
    assert progress[-1].done and progress[-1].collection_version == 2
    assert all(not p.done for p in progress[:-1]) and progress[-1].documents_done == progress[-1].documents_total == 4
    chunks = progress[-1].chunks_done
    assert chunks > 4  # 24-token windows split every document
    about = await info(rag, coll)
    assert about.exists and about.points == chunks and about.version == 2 and about.dimension == 384

    reply = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(query="How many vacation days do I get?", collection=coll, tenant="acme")
    )
    assert len(reply.results) == 4 and reply.collection_version == 2
    top = reply.results[0]
    assert top.document_id == "vacation" and "vacation" in top.text.lower()
    assert top.metadata["topic"] == "vacation" and 0.3 < top.score <= 1.0
    assert [r.score for r in reply.results] == sorted((r.score for r in reply.results), reverse=True)


async def test_search_filters_top_k_and_threshold(rag) -> None:  # type: ignore[no-untyped-def]
    coll = f"filters-{uuid.uuid4().hex[:6]}"
    await upsert(rag, coll, _docs())
    query = "What should I do if I lose my laptop?"
    filtered = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(
            query=query, collection=coll, tenant="acme", top_k=10, filter={"topic": "expenses"}
        )
    )
    assert filtered.results and {r.document_id for r in filtered.results} == {"expenses"}
    none = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(
            query=query, collection=coll, tenant="acme", filter={"topic": "expenses", "lang": "fr"}
        )
    )
    assert list(none.results) == []
    two = await rag.Search(retrieval_pb2.RetrievalSearchRequest(query=query, collection=coll, tenant="acme", top_k=2))
    assert len(two.results) == 2 and two.results[0].document_id == "security"
    strict = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(query=query, collection=coll, tenant="acme", top_k=50, score_threshold=0.3)
    )
    assert strict.results and all(r.score >= 0.3 for r in strict.results)
    assert len(strict.results) < (await info(rag, coll)).points
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rag.Search(retrieval_pb2.RetrievalSearchRequest(query=query, collection=coll, tenant="acme", top_k=51))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(caught.value) == ["top_k"]


async def test_reingesting_replaces_chunks_without_leftovers(rag) -> None:  # type: ignore[no-untyped-def]
    coll = f"reingest-{uuid.uuid4().hex[:6]}"
    first = await upsert(rag, coll, _docs())
    points = (await info(rag, coll)).points
    again = await upsert(rag, coll, _docs())
    assert again[-1].chunks_done == first[-1].chunks_done
    after = await info(rag, coll)
    assert after.points == points and after.version == 4
    old_vacation = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(
            query="vacation days", collection=coll, tenant="acme", top_k=50, filter={"topic": "vacation"}
        )
    )
    assert len(old_vacation.results) > 1
    shorter = await upsert(rag, coll, [common_pb2.Document(id="vacation", text="Vacation is twenty-five days a year.")])
    assert shorter[-1].chunks_done == 1 and shorter[-1].collection_version == 6
    assert (await info(rag, coll)).points == points - len(old_vacation.results) + 1
    hits = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(
            query="vacation days", collection=coll, tenant="acme", top_k=50, filter={"topic": "vacation"}
        )
    )
    assert list(hits.results) == []  # the new version has no metadata: no old chunk is left behind
    assert (
        (
            await rag.Search(
                retrieval_pb2.RetrievalSearchRequest(query="vacation days", collection=coll, tenant="acme", top_k=50)
            )
        )
        .results[0]
        .text.startswith("Vacation is")
    )


async def test_invalid_documents_are_rejected_before_anything_is_written(rag) -> None:  # type: ignore[no-untyped-def]
    coll = f"invalid-{uuid.uuid4().hex[:6]}"
    docs = [
        common_pb2.Document(id="ok", text="fine"),
        common_pb2.Document(id="", text="no id"),
        common_pb2.Document(id="empty", text="   "),
        common_pb2.Document(id="big", text="x" * (MAX_DOC_BYTES + 1)),
        common_pb2.Document(id="meta", text="t", metadata={f"k{i}": "v" for i in range(33)}),
        common_pb2.Document(id="long", text="t", metadata={"k": "v" * 1100}),
        common_pb2.Document(id="ok", text="duplicate"),
    ]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await upsert(rag, coll, docs)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _violations(caught.value) == [
        "documents[1].id",
        "documents[2].text",
        "documents[3].text",
        "documents[4].metadata",
        "documents[5].metadata[k]",
        "documents[6].id",
    ]
    assert not (await info(rag, coll)).exists
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await upsert(rag, coll, [common_pb2.Document(id="a", text="b")], chunk_tokens=16, overlap=9)
    assert _violations(caught.value) == ["overlap_tokens"]  # at most half the window
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await upsert(rag, coll, [common_pb2.Document(id="a", text="b")], chunk_tokens=8, overlap=0)
    assert _violations(caught.value) == ["chunk_tokens"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await upsert(rag, coll, [])
    assert _violations(caught.value) == ["documents"]


async def test_missing_collection_searches_empty(rag) -> None:  # type: ignore[no-untyped-def]
    reply = await rag.Search(retrieval_pb2.RetrievalSearchRequest(query="anything", collection="nope", tenant="acme"))
    assert list(reply.results) == [] and reply.collection_version == 0
    about = await info(rag, "nope")
    assert not about.exists and about.points == 0 and about.version == 0


async def test_delete_documents_bumps_the_version(rag) -> None:  # type: ignore[no-untyped-def]
    coll = f"delete-{uuid.uuid4().hex[:6]}"
    progress = await upsert(rag, coll, _docs())
    before = await info(rag, coll)
    reply = await rag.Delete(
        retrieval_pb2.DeleteRequest(collection=coll, tenant="acme", document_ids=["security", "missing"])
    )
    assert reply.deleted_chunks > 0 and reply.collection_version == 4
    after = await info(rag, coll)
    assert after.points == before.points - reply.deleted_chunks and after.version == 4
    assert progress[-1].chunks_done == before.points
    hits = await rag.Search(
        retrieval_pb2.RetrievalSearchRequest(query="lost laptop", collection=coll, tenant="acme", top_k=50)
    )
    assert "security" not in {h.document_id for h in hits.results}


async def test_tenants_and_default_collection_are_separate(rag) -> None:  # type: ignore[no-untyped-def]
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    await upsert(rag, "", _docs(), tenant=tenant)
    assert (await info(rag, "", tenant=tenant)).exists
    assert (await info(rag, "docs", tenant=tenant)).exists  # "" is the default collection
    other = await rag.Search(retrieval_pb2.RetrievalSearchRequest(query="vacation", tenant=f"{tenant}-other"))
    assert list(other.results) == []


async def test_version_survives_a_restart(models_dir: Path, tmp_path: Path, redis_url: str) -> None:
    versions = f"llmesh-test-versions:{uuid.uuid4().hex[:12]}:"
    async with retrieval_service(models_dir, tmp_path, redis_url, versions=versions) as stub:
        await upsert(stub, "kb", _docs())
        await upsert(stub, "kb", _docs())
        points = (await info(stub, "kb")).points
    async with retrieval_service(models_dir, tmp_path, redis_url, versions=versions) as stub:
        about = await info(stub, "kb")
        assert about.version == 4 and about.points == points
    # A Redis that lost the versions resumes above every version handed out: the store's record is the floor.
    async with retrieval_service(models_dir, tmp_path, redis_url, versions=versions + "lost:") as stub:
        assert (await info(stub, "kb")).version == 4
        progress = await upsert(stub, "kb", _docs())
        assert progress[-1].collection_version == 6


async def test_search_spans_carry_document_ids_and_scores(rag) -> None:  # type: ignore[no-untyped-def]
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llmesh import telemetry

    exporter = InMemorySpanExporter()
    provider = telemetry.setup_tracing("test", exporter=exporter)
    coll = f"spans-{uuid.uuid4().hex[:6]}"
    await upsert(rag, coll, _docs())
    await rag.Search(retrieval_pb2.RetrievalSearchRequest(query="vacation days", collection=coll, tenant="acme"))
    provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"retrieval.chunk", "retrieval.embed", "retrieval.qdrant.upsert", "retrieval.qdrant.search"} <= set(spans)
    assert "vacation" in spans["retrieval.qdrant.upsert"].attributes["llmesh.retrieval.document_ids"]
    search = spans["retrieval.qdrant.search"].attributes
    assert search["llmesh.retrieval.document_ids"][0] == "vacation" and len(search["llmesh.retrieval.scores"]) == 4


async def test_an_ingest_fails_before_writing_anything_while_versions_are_unreachable(
    models_dir: Path, tmp_path: Path
) -> None:
    # No version, no acknowledged ingest: nothing is written that no version would cover.
    async with hosted("tokenizer", TokenizerApp, {"LLMESH_MODELS_DIR": str(models_dir)}) as tok:
        env = {
            "LLMESH_MODELS_DIR": str(models_dir),
            "LLMESH_DATA_DIR": str(tmp_path),
            "LLMESH_REDIS_URL": "redis://127.0.0.1:1/0",
            "LLMESH_REDIS_TIMEOUT_SECONDS": "0.2",
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "QDRANT_URL": "",
        }
        async with hosted("retrieval", RetrievalApp, env) as host:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
                stub = retrieval_pb2_grpc.RetrievalStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await upsert(stub, "kb", _docs())
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert (await info(stub, "kb")).points == 0


async def test_embed_returns_unit_vectors_in_order_with_the_token_count(rag) -> None:  # type: ignore[no-untyped-def]
    texts = [
        "How do I reset my password?",
        "I forgot my password and need to change it.",
        "The quarterly report shows revenue grew eleven percent.",
    ]
    found = await rag.Embed(retrieval_pb2.RetrievalEmbedRequest(inputs=texts))
    assert found.model == "all-MiniLM-L6-v2"
    vectors = [list(v.values) for v in found.vectors]
    assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
    for v in vectors:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-3

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    # Each text alone: the same vector (order kept, no cross-talk), and tokens add up.
    alone = [await rag.Embed(retrieval_pb2.RetrievalEmbedRequest(inputs=[t])) for t in texts]
    for one, v in zip(alone, vectors, strict=True):
        assert cosine(list(one.vectors[0].values), v) > 0.999
    assert found.input_tokens == sum(one.input_tokens for one in alone)
    # [CLS] how do i reset my password ? [SEP]
    assert alone[0].input_tokens == 9


async def test_embed_refuses_bad_inputs_naming_each(rag) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rag.Embed(retrieval_pb2.RetrievalEmbedRequest(inputs=["fine", "", "x" * (16 * 1024 + 1), "ok"]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _violations(caught.value) == ["inputs[1]", "inputs[2]"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rag.Embed(retrieval_pb2.RetrievalEmbedRequest(inputs=[]))
    assert _violations(caught.value) == ["inputs"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rag.Embed(retrieval_pb2.RetrievalEmbedRequest(inputs=["a"] * 257))
    assert _violations(caught.value) == ["inputs"]
