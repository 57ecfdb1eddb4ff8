"""The embedded vector store (llmesh.edge_store, Qdrant Edge) on its own: qdrant-client's calls,
the background HNSW build that searches and writes go on through, the one-process lock, and the
migration of qdrant-client local-mode folders."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from qdrant_client import QdrantClient
from qdrant_client import models as qm

import llmesh.qdrant
from llmesh import edge_store
from llmesh.edge_store import EdgeClient, StoreInUse
from llmesh.qdrant import embedded_path, legacy_path, open_client
from llmesh.testing import service_settings

DIM = 16


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _pid(i: int) -> str:
    return str(uuid.UUID(int=i + 1))


def _points(vectors: np.ndarray, first: int = 0) -> list[qm.PointStruct]:
    return [
        qm.PointStruct(
            id=_pid(first + i), vector=v.tolist(), payload={"tenant": f"t{(first + i) % 4}", "n": first + i, "x": 0.5}
        )
        for i, v in enumerate(vectors)
    ]


def _tenant(value: str) -> qm.Filter:
    return qm.Filter(must=[qm.FieldCondition(key="tenant", match=qm.MatchValue(value=value))])


def test_qdrant_client_calls_on_edge_and_data_survives_close(tmp_path: Path) -> None:
    vectors = _vectors(200)
    client = EdgeClient(tmp_path / "store", background_builds=False)
    assert not client.collection_exists("c")
    assert client.create_collection("c", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.DOT))
    client.create_payload_index("c", "tenant", qm.PayloadSchemaType.KEYWORD)
    client.create_payload_index("c", "x", qm.PayloadSchemaType.FLOAT)
    client.create_payload_index("c", "tenant", qm.PayloadSchemaType.KEYWORD)  # idempotent
    assert client.payload_indexes("c").keys() == {"tenant", "x"}
    client.upsert("c", points=_points(vectors), wait=True)
    assert client.vector_size("c") == DIM
    assert client.count("c").count == 200
    assert client.count("c", count_filter=_tenant("t1")).count == 50

    found = client.query_points("c", query=vectors[5].tolist(), limit=3, with_payload=True).points
    assert found[0].id == _pid(5) and found[0].score == pytest.approx(1.0, abs=1e-5)
    assert found[0].payload == {"tenant": "t1", "n": 5, "x": 0.5}
    scoped = client.query_points("c", query=vectors[5].tolist(), query_filter=_tenant("t2"), limit=50).points
    assert len(scoped) == 50 and all(p.payload and p.payload["tenant"] == "t2" for p in scoped)
    only_key = client.query_points("c", query=vectors[5].tolist(), limit=1, with_payload=["n"]).points
    assert only_key[0].payload == {"n": 5}
    above = client.query_points("c", query=vectors[5].tolist(), limit=10, score_threshold=0.99).points
    assert [p.id for p in above] == [_pid(5)]
    ranged = qm.Filter(must=[qm.FieldCondition(key="x", range=qm.Range(lt=0.4))])
    assert client.count("c", count_filter=ranged).count == 0

    assert [str(r.id) for r in client.retrieve("c", ids=[_pid(3), _pid(999)], with_payload=False)] == [_pid(3)]
    client.delete("c", points_selector=qm.FilterSelector(filter=_tenant("t0")), wait=True)
    client.delete("c", points_selector=qm.PointIdsList(points=[_pid(1)]))
    assert client.count("c").count == 149
    client.close()

    reopened = EdgeClient(tmp_path / "store", background_builds=False)
    try:
        assert reopened.collection_exists("c") and reopened.count("c").count == 149
        assert reopened.payload_indexes("c").keys() == {"tenant", "x"}
        assert not reopened.retrieve("c", ids=[_pid(1), _pid(4)])
    finally:
        reopened.close()


def test_index_build_runs_beside_searches_and_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HNSW build runs in a child process on a copy: searches and writes go on meanwhile (the
    writes are replayed onto the optimized copy), and the swap loses nothing."""
    monkeypatch.setattr(edge_store, "INDEXING_THRESHOLD_KB", 64)  # 1,024 16-d vectors per indexed segment
    vectors = _vectors(4000)
    client = EdgeClient(tmp_path / "store", background_builds=False)
    try:
        client.create_collection("c", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.DOT))
        client.create_payload_index("c", "tenant", qm.PayloadSchemaType.KEYWORD)
        client.upsert("c", points=_points(vectors[:3000]))
        assert client.indexed("c") == (3000, 0)

        built: list[bool] = []
        builder = threading.Thread(target=lambda: built.append(client.build_index("c")))
        builder.start()
        searches_while_building = 0
        written = 3000
        while builder.is_alive():
            found = client.query_points("c", query=vectors[7].tolist(), query_filter=_tenant("t3"), limit=2).points
            assert found[0].id == _pid(7)
            if client._child is not None and client._child.poll() is None:
                searches_while_building += 1
                if written < 4000:  # writes during the build: new points and a delete
                    client.upsert("c", points=_points(vectors[written : written + 100], first=written))
                    written += 100
                    client.delete("c", points_selector=qm.PointIdsList(points=[_pid(written - 1)]))
        builder.join()
        assert built == [True]
        assert searches_while_building >= 10, "searches stalled while the index was built"
        assert written > 3000, "no write landed during the build"

        points, indexed = client.indexed("c")
        deleted = (written - 3000) // 100
        assert points == written - deleted and indexed >= 3000
        assert client.count("c", count_filter=_tenant("t0")).count == len(
            [i for i in range(written) if i % 4 == 0 and not (i >= 3000 and i % 100 == 99)]
        )
        assert client.retrieve("c", ids=[_pid(written - 2)], with_payload=False)
        assert not client.retrieve("c", ids=[_pid(written - 1)], with_payload=False)
        live = (tmp_path / "store" / "c" / "CURRENT").read_text().strip()
        assert live == "g000002"
        assert sorted(p.name for p in (tmp_path / "store" / "c").iterdir() if p.is_dir()) == [live]
    finally:
        client.close()
    reopened = EdgeClient(tmp_path / "store", background_builds=False)
    try:
        assert reopened.indexed("c")[0] == written - (written - 3000) // 100
    finally:
        reopened.close()


def test_writes_are_indexed_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the services rely on: nobody calls build_index; once writes pause, the store indexes."""
    monkeypatch.setattr(edge_store, "INDEXING_THRESHOLD_KB", 64)
    monkeypatch.setattr(edge_store, "BUILD_MIN_UNINDEXED_KB", 128)  # 2,048 16-d vectors
    monkeypatch.setattr(edge_store, "BUILD_QUIET_S", 0.2)
    monkeypatch.setattr(edge_store, "BUILD_CHECK_S", 0.1)
    client = EdgeClient(tmp_path / "store")
    try:
        client.create_collection("c", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.DOT))
        client.upsert("c", points=_points(_vectors(1000)))
        client.upsert("c", points=_points(_vectors(2000, seed=1), first=1000))
        assert client.indexing("c"), "3,000 unindexed vectors and no build pending"
        deadline = time.monotonic() + 120
        while client.indexing("c") and time.monotonic() < deadline:
            threading.Event().wait(0.2)
        assert client.indexed("c") == (3000, 3000)
        assert not client.indexing("c")
        assert (tmp_path / "store" / "c" / "CURRENT").read_text().strip() == "g000002"
    finally:
        client.close()


def test_a_second_process_gets_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "store"
    client = EdgeClient(root, background_builds=False)
    try:
        client.create_collection("c", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.DOT))
        code = f"from llmesh.edge_store import EdgeClient; EdgeClient(__import__('pathlib').Path({str(root)!r}))"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert other.returncode != 0
        assert "StoreInUse" in other.stderr and "in use by another process" in other.stderr
        assert "QDRANT_URL" in other.stderr
        with pytest.raises(StoreInUse):
            EdgeClient(root, background_builds=False)
    finally:
        client.close()
    EdgeClient(root, background_builds=False).close()  # released on close


def _legacy_store(path: Path, n: int) -> np.ndarray:
    vectors = _vectors(n, seed=3)
    old = QdrantClient(path=str(path))
    old.create_collection("llmesh_cache_d16", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.DOT))
    old.upsert("llmesh_cache_d16", points=_points(vectors))
    old.create_collection("llmesh_meta", vectors_config=qm.VectorParams(size=1, distance=qm.Distance.DOT))
    old.upsert("llmesh_meta", points=[qm.PointStruct(id=_pid(0), vector=[1.0], payload={"version": 7})])
    old.close()
    return vectors


def test_local_mode_folder_is_migrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llmesh.qdrant, "MIGRATE_BATCH", 64)  # several pages
    settings = service_settings("cache", {"LLMESH_DATA_DIR": str(tmp_path), "QDRANT_URL": ""})
    vectors = _legacy_store(legacy_path(settings, "cache"), 300)
    handle = open_client(settings, "cache")
    try:
        client = handle.client
        assert handle.local and client.count("llmesh_cache_d16").count == 300
        found = client.query_points("llmesh_cache_d16", query=vectors[42].tolist(), limit=1).points
        assert found[0].id == _pid(42) and found[0].payload == {"tenant": "t2", "n": 42, "x": 0.5}
        assert client.retrieve("llmesh_meta", ids=[_pid(0)])[0].payload == {"version": 7}
    finally:
        handle.close()
    assert not legacy_path(settings, "cache").exists()
    assert (tmp_path / "qdrant-cache.migrated" / "meta.json").exists()
    assert embedded_path(settings, "cache").is_dir()


def test_local_mode_folder_is_refused_when_it_cannot_be_migrated(tmp_path: Path) -> None:
    settings = service_settings("retrieval", {"LLMESH_DATA_DIR": str(tmp_path), "QDRANT_URL": ""})
    legacy = legacy_path(settings, "retrieval")
    _legacy_store(legacy, 10)
    holder = QdrantClient(path=str(legacy))  # the old store still open (an old process)
    try:
        with pytest.raises(RuntimeError, match="in use by another process"):
            open_client(settings, "retrieval")
    finally:
        holder.close()
    assert (legacy / "meta.json").exists() and not embedded_path(settings, "retrieval").exists()

    # Edge data already there as well: which one is meant is not guessed.
    edge = EdgeClient(embedded_path(settings, "retrieval"), background_builds=False)
    edge.create_collection("c", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.DOT))
    edge.close()
    with pytest.raises(RuntimeError, match="remove or move one of them"):
        open_client(settings, "retrieval")
    assert (legacy / "meta.json").exists()
