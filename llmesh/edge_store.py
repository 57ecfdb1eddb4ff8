"""Embedded vector store: Qdrant Edge (Qdrant's own engine, in-process), one shard per collection.

`EdgeClient` answers the subset of qdrant-client's API the services use (same method names,
arguments and result types), so retrieval and the cache run the same code on a Qdrant server
(`QDRANT_URL`) and embedded. Layout under the store folder:

    .lock                      held (flock) by the one process that has the store open
    <collection>/collection.json   {"size": .., "distance": ..}
    <collection>/CURRENT       name of the live generation
    <collection>/g<N>/         the Edge shard of generation N

HNSW indexes are built by Edge's optimizer. `EdgeShard.optimize()` holds the GIL for the whole
build (minutes at 100k points on two cores), which would freeze the event loop, so it never runs
in the serving process: after writes settle, a copy of the shard is optimized by a child process
(`python -m llmesh.edge_store optimize DIR`, at low priority) while searches and writes go on;
the writes made meanwhile are replayed onto the optimized copy, which then replaces the live
shard (a reference swap plus an atomic CURRENT rename, so a crash at any point leaves one
complete generation).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import qdrant_edge as qe
from qdrant_client import models as qm
from qdrant_client.http.models import QueryResponse

log = logging.getLogger("llmesh.qdrant")

LOCK_FILE = ".lock"
META_FILE = "collection.json"
CURRENT_FILE = "CURRENT"
# Segments above this size (KB of vectors) get an HNSW index when optimized (~2.7k 384-d vectors);
# smaller ones are searched exactly, which is as fast at that size.
INDEXING_THRESHOLD_KB = 4096
# A background build starts once this many bytes of vectors are not in an HNSW index ...
BUILD_MIN_UNINDEXED_KB = 2 * INDEXING_THRESHOLD_KB
# ... and no write came for this long (a bulk ingest is indexed once, at its end), or, under
# writes that never pause (a busy cache), once this many are.
BUILD_QUIET_S = 2.0
BUILD_FORCE_UNINDEXED_KB = 4 * BUILD_MIN_UNINDEXED_KB
BUILD_CHECK_S = 1.0
# Writes made during a build are kept to replay onto the optimized copy; past this many points the
# build is dropped (the next quiet period starts a new one).
MAX_REPLAY_POINTS = 50_000
NICE = 10

_DISTANCES = {
    qm.Distance.DOT: qe.Distance.Dot,
    qm.Distance.COSINE: qe.Distance.Cosine,
    qm.Distance.EUCLID: qe.Distance.Euclid,
    qm.Distance.MANHATTAN: qe.Distance.Manhattan,
}
_SCHEMAS = {
    qm.PayloadSchemaType.KEYWORD: qe.PayloadSchemaType.Keyword,
    qm.PayloadSchemaType.INTEGER: qe.PayloadSchemaType.Integer,
    qm.PayloadSchemaType.FLOAT: qe.PayloadSchemaType.Float,
    qm.PayloadSchemaType.BOOL: qe.PayloadSchemaType.Bool,
    qm.PayloadSchemaType.UUID: qe.PayloadSchemaType.Uuid,
}


class StoreInUse(RuntimeError):
    """Another process has the embedded store open."""


# ----- qdrant-client models -> Edge


def _condition(cond: Any) -> Any:
    if isinstance(cond, qm.Filter):
        return edge_filter(cond)
    if not isinstance(cond, qm.FieldCondition):
        raise TypeError(f"embedded store: unsupported filter condition {type(cond).__name__}")
    if isinstance(cond.match, qm.MatchValue):
        return qe.FieldCondition(key=cond.key, match=qe.MatchValue(cond.match.value))
    if isinstance(cond.match, qm.MatchAny):
        return qe.FieldCondition(key=cond.key, match=qe.MatchAny(cast(list[str], list(cond.match.any))))
    if isinstance(cond.range, qm.Range):
        r = cond.range
        return qe.FieldCondition(key=cond.key, range=qe.RangeFloat(gte=r.gte, gt=r.gt, lte=r.lte, lt=r.lt))
    raise TypeError(f"embedded store: unsupported field condition on {cond.key!r}")


def _conditions(conds: Any) -> list[Any] | None:
    if conds is None:
        return None
    return [_condition(c) for c in (conds if isinstance(conds, list) else [conds])]


def edge_filter(flt: qm.Filter | None) -> Any:
    if flt is None:
        return None
    return qe.Filter(must=_conditions(flt.must), should=_conditions(flt.should), must_not=_conditions(flt.must_not))


def _point_id(value: Any) -> str | int:
    return str(value) if isinstance(value, uuid.UUID) else value


def _with_payload(value: bool | Sequence[str]) -> bool | list[str]:
    return value if isinstance(value, bool) else list(value)


# ----- one collection


class _Collection:
    """One collection: its live shard, a readers/writers discipline for the swap, the replay log."""

    def __init__(self, path: Path, size: int, distance: str) -> None:
        self.path = path
        self.size = size
        self.distance = distance
        self.write_lock = threading.Lock()
        self._readers = 0
        self._cond = threading.Condition()
        self.replay: list[Any] | None = None  # update operations made since a build's copy
        self.replay_points = 0
        self.last_write = 0.0
        self.dirty = False
        self.building = False  # a background HNSW build is running on a copy
        self.generation = _read_current(path)
        self.shard = qe.EdgeShard.load(str(path / self.generation))

    @contextmanager
    def reading(self) -> Iterator[Any]:
        with self._cond:
            self._readers += 1
            shard = self.shard
        try:
            yield shard
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def update(self, op: Any, points: int = 0) -> None:
        with self.write_lock:
            self.shard.update(op)
            if self.replay is not None:
                self.replay.append(op)
                self.replay_points += points
            self.last_write = time.monotonic()
            self.dirty = True

    def swap(self, shard: Any, generation: str) -> Any:
        """Makes `shard` live (caller holds write_lock); returns the old one once no reader uses it."""
        with self._cond:
            old, self.shard = self.shard, shard
            self.generation = generation
            while self._readers:
                self._cond.wait()
        return old

    def close(self) -> None:
        with self.write_lock, self._cond:
            while self._readers:
                self._cond.wait()
            self.shard.flush()
            self.shard.close()


def _read_current(path: Path) -> str:
    return (path / CURRENT_FILE).read_text().strip()


def _write_current(path: Path, generation: str) -> None:
    tmp = path / f"{CURRENT_FILE}.tmp"
    tmp.write_text(generation + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path / CURRENT_FILE)


def _next_generation(generation: str) -> str:
    return f"g{int(generation[1:]) + 1:06d}"


def _edge_config(size: int, distance: str) -> Any:
    return qe.EdgeConfig(
        vectors=qe.EdgeVectorParams(size=size, distance=_DISTANCES[qm.Distance(distance)]),
        optimizers=qe.EdgeOptimizersConfig(indexing_threshold=INDEXING_THRESHOLD_KB),
    )


# ----- the client


class EdgeClient:
    """qdrant-client's calls the services make, on Qdrant Edge shards under `root`.

    Thread-safe: searches run concurrently; writes to one collection are serialized."""

    def __init__(self, root: Path, *, background_builds: bool = True) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreInUse(
                f"embedded Qdrant at {root} is in use by another process; only one process may open it: "
                "give each replica its own LLMESH_DATA_DIR or set QDRANT_URL to a Qdrant server"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        self._collections: dict[str, _Collection] = {}
        self._registry = threading.Lock()
        self._closed = threading.Event()
        self._child: subprocess.Popen[bytes] | None = None
        for path in sorted(p for p in root.iterdir() if (p / META_FILE).exists()):
            self._collections[path.name] = self._load(path)
        self._builder: threading.Thread | None = None
        if background_builds:
            self._builder = threading.Thread(target=self._build_loop, name="qdrant-edge-builder", daemon=True)
            self._builder.start()

    @staticmethod
    def _load(path: Path) -> _Collection:
        meta = json.loads((path / META_FILE).read_text())
        live = _read_current(path)
        for stale in path.iterdir():  # an interrupted build, or an old generation left by a crash
            if stale.is_dir() and stale.name != live:
                shutil.rmtree(stale, ignore_errors=True)
        return _Collection(path, int(meta["size"]), str(meta["distance"]))

    def _get(self, name: str) -> _Collection:
        coll = self._collections.get(name)
        if coll is None:
            raise ValueError(f"Collection {name} not found")
        return coll

    # ----- collections

    def collection_exists(self, collection_name: str) -> bool:
        return collection_name in self._collections

    def get_collections(self) -> list[str]:
        return sorted(self._collections)

    def create_collection(self, collection_name: str, vectors_config: qm.VectorParams) -> bool:
        with self._registry:
            if collection_name in self._collections:
                return False
            path = self.root / collection_name
            if path.exists():  # a create that crashed half way
                shutil.rmtree(path)
            path.mkdir()
            distance = qm.Distance(vectors_config.distance).value
            qe.EdgeShard.create(str(path / "g000001"), _edge_config(vectors_config.size, distance)).close()
            _write_current(path, "g000001")
            (path / META_FILE).write_text(json.dumps({"size": vectors_config.size, "distance": distance}))
            self._collections[collection_name] = _Collection(path, vectors_config.size, distance)
            return True

    def vector_size(self, collection_name: str) -> int:
        return self._get(collection_name).size

    def create_payload_index(
        self, collection_name: str, field_name: str, field_schema: qm.PayloadSchemaType, wait: bool = True
    ) -> None:
        coll = self._get(collection_name)
        with coll.reading() as shard:
            if field_name in shard.info().payload_schema:
                return
        coll.update(qe.UpdateOperation.create_field_index(field_name, _SCHEMAS[qm.PayloadSchemaType(field_schema)]))

    def payload_indexes(self, collection_name: str) -> dict[str, str]:
        with self._get(collection_name).reading() as shard:
            return {k: str(v.data_type) for k, v in shard.info().payload_schema.items()}

    # ----- points

    def upsert(self, collection_name: str, points: Sequence[qm.PointStruct], wait: bool = True) -> None:
        coll = self._get(collection_name)
        edge_points = [qe.Point(p.id, cast(list[float], p.vector), p.payload) for p in points]
        coll.update(qe.UpdateOperation.upsert_points(edge_points), len(edge_points))

    def upsert_arrays(
        self, collection_name: str, ids: Sequence[str | int], vectors: Any, payloads: Sequence[dict[str, Any]]
    ) -> None:
        """Bulk load without per-point models (benchmarks, migration): vectors is an (n, d) float32 array."""
        coll = self._get(collection_name)
        edge_points = [qe.Point(i, v, p) for i, v, p in zip(ids, vectors, payloads, strict=True)]
        coll.update(qe.UpdateOperation.upsert_points(edge_points), len(edge_points))

    def delete(self, collection_name: str, points_selector: Any, wait: bool = True) -> None:
        coll = self._get(collection_name)
        if isinstance(points_selector, qm.FilterSelector):
            op = qe.UpdateOperation.delete_points_by_filter(edge_filter(points_selector.filter))
        elif isinstance(points_selector, qm.PointIdsList):
            op = qe.UpdateOperation.delete_points([_point_id(p) for p in points_selector.points])
        else:
            raise TypeError(f"embedded store: unsupported points selector {type(points_selector).__name__}")
        coll.update(op)

    def retrieve(
        self, collection_name: str, ids: Sequence[Any], with_payload: bool | Sequence[str] = True
    ) -> list[qm.Record]:
        with self._get(collection_name).reading() as shard:
            found = shard.retrieve([_point_id(i) for i in ids], _with_payload(with_payload), False)
        return [qm.Record(id=_point_id(r.id), payload=r.payload) for r in found]

    def count(self, collection_name: str, count_filter: qm.Filter | None = None, exact: bool = True) -> qm.CountResult:
        with self._get(collection_name).reading() as shard:
            return qm.CountResult(count=shard.count(qe.CountRequest(exact=exact, filter=edge_filter(count_filter))))

    def query_points(
        self,
        collection_name: str,
        query: Sequence[float],
        query_filter: qm.Filter | None = None,
        limit: int = 10,
        score_threshold: float | None = None,
        with_payload: bool | Sequence[str] = True,
    ) -> QueryResponse:
        request = qe.QueryRequest(
            limit=limit,
            query=qe.Query.Nearest(list(query)),
            filter=edge_filter(query_filter),
            score_threshold=score_threshold,
            with_payload=_with_payload(with_payload),
        )
        with self._get(collection_name).reading() as shard:
            found = shard.query(request)
        return QueryResponse(
            points=[qm.ScoredPoint(id=_point_id(p.id), version=0, score=p.score, payload=p.payload) for p in found]
        )

    def indexed(self, collection_name: str) -> tuple[int, int]:
        """(points, vectors in an HNSW index)."""
        with self._get(collection_name).reading() as shard:
            info = shard.info()
        return int(info.points_count), int(info.indexed_vectors_count)

    def indexing(self, collection_name: str) -> bool:
        """Whether a background HNSW build is pending or running for the collection."""
        coll = self._get(collection_name)
        return coll.building or (coll.dirty and self.unindexed_kb(collection_name) >= BUILD_MIN_UNINDEXED_KB)

    # ----- lifecycle

    def flush(self) -> None:
        for coll in list(self._collections.values()):
            with coll.write_lock:
                coll.shard.flush()

    def close(self) -> None:
        """Stops a build in progress, flushes and closes every shard, releases the folder."""
        if self._closed.is_set():
            return
        self._closed.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()
        if self._builder is not None:
            self._builder.join(timeout=30)
        for coll in self._collections.values():
            coll.close()
        os.close(self._lock_fd)

    # ----- background HNSW builds

    def _build_loop(self) -> None:
        while not self._closed.wait(BUILD_CHECK_S):
            for name, coll in list(self._collections.items()):
                if self._closed.is_set():
                    return
                if not coll.dirty:
                    continue
                quiet = time.monotonic() - coll.last_write >= BUILD_QUIET_S
                unindexed_kb = self.unindexed_kb(name)
                if unindexed_kb < BUILD_MIN_UNINDEXED_KB:
                    if quiet:
                        coll.dirty = False  # small enough to search exactly
                    continue
                if not quiet and unindexed_kb < BUILD_FORCE_UNINDEXED_KB:
                    continue
                try:
                    self.build_index(name)
                except Exception as exc:
                    if not self._closed.is_set():
                        log.warning("background index build of %s failed: %s", name, exc)

    def unindexed_kb(self, name: str) -> float:
        """KB of vectors searched exactly (not in an HNSW index yet)."""
        points, indexed = self.indexed(name)
        return (points - indexed) * self._get(name).size * 4 / 1024

    def build_index(self, name: str, nice: int = NICE) -> bool:
        """Optimizes a copy of the collection's shard in a child process (at niceness `nice`, so
        serving keeps the cores) and swaps it in; returns whether it did. Safe to call while
        searches and writes go on."""
        coll = self._get(name)
        coll.building, coll.dirty = True, False
        with coll.write_lock:
            generation = _next_generation(coll.generation)
            target = coll.path / generation
            coll.shard.flush()
            shutil.copytree(coll.path / coll.generation, target, ignore=shutil.ignore_patterns("*.lock"))
            coll.replay, coll.replay_points = [], 0
        started = time.monotonic()
        built = None
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "llmesh.edge_store", "optimize", str(target), str(nice)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            _, err = self._child.communicate()
            if self._child.returncode != 0:
                raise RuntimeError(f"optimizer exited {self._child.returncode}: {err.decode(errors='replace')[-500:]}")
            if self._closed.is_set():
                raise RuntimeError("store closing")
            built = qe.EdgeShard.load(str(target))
            with coll.write_lock:
                if coll.replay_points > MAX_REPLAY_POINTS:
                    raise RuntimeError(f"{coll.replay_points} points written during the build; retrying later")
                for op in coll.replay or []:
                    built.update(op)
                built.flush()
                _write_current(coll.path, generation)
                old_generation = coll.generation
                old = coll.swap(built, generation)
                built = None  # live now
                coll.replay = None
        except BaseException:
            if built is not None:
                built.close()
            with coll.write_lock:
                coll.replay = None
                coll.dirty = True
            shutil.rmtree(target, ignore_errors=True)
            raise
        finally:
            self._child = None
            coll.building = False
        old.close()
        shutil.rmtree(coll.path / old_generation, ignore_errors=True)
        points, indexed = self.indexed(name)
        seconds = time.monotonic() - started
        log.info("HNSW index of %s built in %.1fs (%d of %d points indexed)", name, seconds, indexed, points)
        return True


def _optimize_main(path: str, nice: int) -> None:
    os.nice(nice)
    shard = qe.EdgeShard.load(path)
    try:
        shard.optimize()
        shard.flush()
    finally:
        shard.close()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "optimize":
        sys.exit("usage: python -m llmesh.edge_store optimize SHARD_DIR NICENESS")
    _optimize_main(sys.argv[2], int(sys.argv[3]))
