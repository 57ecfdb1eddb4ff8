"""The one way services open Qdrant: a Qdrant server (QDRANT_URL, QDRANT_API_KEY) or, when no URL
is set, the embedded store: Qdrant Edge shards under `$LLMESH_DATA_DIR/qdrant-edge-<service>`
(llmesh.edge_store), held by this process alone.

Both answer the same calls (qdrant-client's names and models), so the services run one code path.
Calls run on worker threads through `QdrantHandle.run`, never on the event loop.

A folder written by the earlier embedded store (qdrant-client's local mode,
`$LLMESH_DATA_DIR/qdrant-<service>`) is migrated into Edge shards on first open and then renamed
`qdrant-<service>.migrated`; if it cannot be (in use, or both folders exist) the service refuses
to start and says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from qdrant_client import QdrantClient
from qdrant_client import models as qm
from qdrant_client.http.exceptions import ResponseHandlingException
from qdrant_client.http.models import QueryResponse

from llmesh.edge_store import EdgeClient, StoreInUse
from llmesh.settings import CacheServiceSettings, RetrievalServiceSettings

log = logging.getLogger("llmesh.qdrant")
T = TypeVar("T")

SERVER_TIMEOUT_SECONDS = 10
SERVER_WORKERS = 4
# Edge searches release the GIL and run concurrently; writes to a collection are serialized.
EMBEDDED_WORKERS = 4
MIGRATE_BATCH = 1000
MIGRATED_SUFFIX = ".migrated"


class VectorClient(Protocol):
    """The calls the services make: qdrant-client's, which EdgeClient answers too."""

    def collection_exists(self, collection_name: str) -> bool: ...

    def create_collection(self, collection_name: str, vectors_config: qm.VectorParams) -> bool: ...

    def create_payload_index(
        self, collection_name: str, field_name: str, field_schema: qm.PayloadSchemaType, wait: bool = True
    ) -> Any: ...

    def upsert(self, collection_name: str, points: Sequence[qm.PointStruct], wait: bool = True) -> Any: ...

    def delete(self, collection_name: str, points_selector: Any, wait: bool = True) -> Any: ...

    def retrieve(
        self, collection_name: str, ids: Sequence[Any], with_payload: bool | Sequence[str] = True
    ) -> list[qm.Record]: ...

    def count(
        self, collection_name: str, count_filter: qm.Filter | None = None, exact: bool = True
    ) -> qm.CountResult: ...

    def query_points(
        self,
        collection_name: str,
        query: Sequence[float],
        query_filter: qm.Filter | None = None,
        limit: int = 10,
        score_threshold: float | None = None,
        with_payload: bool | Sequence[str] = True,
    ) -> QueryResponse: ...

    def close(self) -> None: ...


class QdrantHandle:
    """A Qdrant client (server or embedded) plus the threads its blocking calls run on."""

    def __init__(self, client: VectorClient, executor: ThreadPoolExecutor, edge: EdgeClient | None = None) -> None:
        self.client = client
        self._executor = executor
        #: The embedded store; None for a Qdrant server.
        self.edge = edge
        #: False from a call that got no reply (refused, timed out) until a call gets one.
        self.reachable = True

    @property
    def local(self) -> bool:
        return self.edge is not None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        except ResponseHandlingException:  # the client's wrapper for "no reply from the server"
            self.reachable = False
            raise
        self.reachable = True
        return result

    def vector_size(self, collection: str) -> int:
        """Blocking: the dimension of the collection's vectors (0 when not a single dense vector)."""
        if self.edge is not None:
            return self.edge.vector_size(collection)
        params = cast(QdrantClient, self.client).get_collection(collection).config.params.vectors
        size = getattr(params, "size", None)
        return int(size) if size is not None else 0

    def index_state(self, collection: str) -> tuple[int, bool]:
        """Blocking: (vectors in an HNSW index, whether an index build is pending or running)."""
        if self.edge is not None:
            return self.edge.indexed(collection)[1], self.edge.indexing(collection)
        info = cast(QdrantClient, self.client).get_collection(collection)
        return int(info.indexed_vectors_count or 0), info.status != qm.CollectionStatus.GREEN

    def close(self) -> None:
        """Blocking: flushes the embedded store to disk (the drain path) and releases it."""
        try:
            self.client.close()
        except Exception:  # closing is best effort
            log.warning("closing the Qdrant client failed", exc_info=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


#: The services that keep vectors in Qdrant.
StoreServiceSettings = CacheServiceSettings | RetrievalServiceSettings


def embedded_path(settings: StoreServiceSettings, service: str) -> Path:
    return settings.runtime.data_path / f"qdrant-edge-{service}"


def legacy_path(settings: StoreServiceSettings, service: str) -> Path:
    """Where qdrant-client's local mode kept the service's data before Qdrant Edge."""
    return settings.runtime.data_path / f"qdrant-{service}"


def open_client(settings: StoreServiceSettings, service: str) -> QdrantHandle:
    """Blocking: opens the server client or the embedded store (created when missing)."""
    url = settings.store.qdrant_url
    if url:
        client = QdrantClient(url=url, api_key=settings.store.qdrant_api_key or None, timeout=SERVER_TIMEOUT_SECONDS)
        executor = ThreadPoolExecutor(SERVER_WORKERS, thread_name_prefix="qdrant")
        return QdrantHandle(cast(VectorClient, client), executor)
    path = embedded_path(settings, service)
    legacy = legacy_path(settings, service)
    if (legacy / "meta.json").exists():
        migrate_local_mode(legacy, path)
    try:
        edge = EdgeClient(path)
    except StoreInUse as exc:
        raise RuntimeError(str(exc)) from None
    log.info("embedded Qdrant (Edge) at %s", path)
    return QdrantHandle(edge, ThreadPoolExecutor(EMBEDDED_WORKERS, thread_name_prefix="qdrant-edge"), edge)


def migrate_local_mode(legacy: Path, target: Path) -> dict[str, int]:
    """Copies every collection of a qdrant-client local-mode folder (ids, vectors, payloads) into
    Edge shards at `target`, then renames the old folder `<name>.migrated`. Returns the points
    copied per collection. Raises RuntimeError, saying what to do, when it cannot."""
    if target.exists() and any((p / "collection.json").exists() for p in target.iterdir()):
        raise RuntimeError(
            f"{legacy} holds data of the old embedded store (qdrant-client local mode) and {target} holds "
            f"Qdrant Edge data: remove or move one of them (the old folder is migrated when {target} is absent)"
        )
    staging = target.with_name(target.name + ".migrating")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        old = QdrantClient(path=str(legacy))
    except RuntimeError as exc:  # local mode's folder lock
        raise RuntimeError(
            f"cannot migrate {legacy} (qdrant-client local mode) to Qdrant Edge: "
            f"it is in use by another process ({exc})"
        ) from exc
    copied: dict[str, int] = {}
    try:
        edge = EdgeClient(staging, background_builds=False)
        try:
            for described in old.get_collections().collections:
                name = described.name
                params = old.get_collection(name).config.params.vectors
                if not isinstance(params, qm.VectorParams):
                    raise RuntimeError(f"cannot migrate {legacy}: collection {name} has named vectors")
                edge.create_collection(name, vectors_config=qm.VectorParams(size=params.size, distance=params.distance))
                offset: Any = None
                total = 0
                while True:
                    records, offset = old.scroll(
                        name, limit=MIGRATE_BATCH, offset=offset, with_payload=True, with_vectors=True
                    )
                    if records:
                        points = [
                            qm.PointStruct(id=r.id, vector=cast(list[float], r.vector), payload=r.payload)
                            for r in records
                        ]
                        edge.upsert(name, points)
                        total += len(records)
                    if offset is None:
                        break
                if edge.count(name).count != total:
                    raise RuntimeError(f"migration of {name} from {legacy} copied {edge.count(name).count} of {total}")
                copied[name] = total
        finally:
            edge.close()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        old.close()
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    legacy.rename(legacy.with_name(legacy.name + MIGRATED_SUFFIX))
    log.warning(
        "migrated %s (qdrant-client local mode) to Qdrant Edge at %s: %s; the old folder is kept as %s%s",
        legacy,
        target,
        ", ".join(f"{k}={v} points" for k, v in copied.items()) or "no collections",
        legacy.name,
        MIGRATED_SUFFIX,
    )
    return copied
