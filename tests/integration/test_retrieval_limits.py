"""The retrieval service bounds what callers' names can make: collections per tenant
(LLMESH_MAX_COLLECTIONS_PER_TENANT) and the collection labels of llmesh_retrieval_points
(LLMESH_METRICS_MAX_COLLECTIONS). The real service with the real tokenizer service, MiniLM and
embedded Qdrant in a temp folder."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from llmesh.errors import status_details, unpack_details
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, retrieval_pb2, retrieval_pb2_grpc
from services.retrieval.core import physical_name
from services.retrieval.servicer import RetrievalApp
from services.tokenizer.servicer import TokenizerApp

DOCS = [common_pb2.Document(id="note", text="The office opens at nine and closes at six on weekdays.")]


async def upsert(stub: retrieval_pb2_grpc.RetrievalStub, tenant: str, collection: str) -> None:
    request = retrieval_pb2.UpsertRequest(collection=collection, tenant=tenant, documents=DOCS, chunk_tokens=16)
    progress = [p async for p in stub.Upsert(request, timeout=60)]
    assert progress[-1].done


def points_series() -> dict[str, float]:
    return {
        s.labels["collection"]: s.value
        for metric in REGISTRY.collect()
        if metric.name == "llmesh_retrieval_points"
        for s in metric.samples
    }


async def test_a_tenants_collection_past_the_limit_is_refused_and_metric_labels_stay_bounded(
    models_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path),
        "LLMESH_REDIS_URL": redis_url,
        "QDRANT_URL": "",
        "LLMESH_MAX_COLLECTIONS_PER_TENANT": "2",
        "LLMESH_METRICS_MAX_COLLECTIONS": "3",
    }
    tenant, neighbour = f"acme-{uuid.uuid4().hex[:8]}", f"beta-{uuid.uuid4().hex[:8]}"
    async with hosted("tokenizer", TokenizerApp, env) as tok:
        env["LLMESH_TOKENIZER_TARGET"] = f"127.0.0.1:{tok.port}"
        async with hosted("retrieval", RetrievalApp, env) as host:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
                stub = retrieval_pb2_grpc.RetrievalStub(channel)
                await upsert(stub, tenant, "a")
                await upsert(stub, tenant, "b")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await upsert(stub, tenant, "c")
                err = caught.value
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "LLMESH_MAX_COLLECTIONS_PER_TENANT (2)" in (err.details() or "")
                info = unpack_details(status_details(err.trailing_metadata()))["error_info"]
                assert info.reason == "COLLECTION_LIMIT"  # type: ignore[attr-defined]
                assert dict(info.metadata) == {"limit": "2", "collections": "2"}  # type: ignore[attr-defined]
                # Nothing of it was made, and the tenant's own collections still take ingests.
                request = retrieval_pb2.CollectionInfoRequest(collection="c", tenant=tenant)
                assert not (await stub.GetCollectionInfo(request)).exists
                await upsert(stub, tenant, "a")
                # The limit is per tenant: another has its own.
                await upsert(stub, neighbour, "a")
                await upsert(stub, neighbour, "b")
                request = retrieval_pb2.CollectionInfoRequest(collection="b", tenant=neighbour)
                last = await stub.GetCollectionInfo(request)

    # Four collections, three labels: the fourth's points are counted under `_other`.
    made = [physical_name(tenant, "a"), physical_name(tenant, "b"), physical_name(neighbour, "a")]
    series = points_series()
    assert [name for name in made if name in series] == made
    assert physical_name(neighbour, "b") not in series
    assert physical_name(tenant, "c") not in series
    assert last.points > 0 and series["_other"] == last.points
