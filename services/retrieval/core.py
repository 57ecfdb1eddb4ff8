"""Retrieval domain logic (no gRPC): validation, chunking through a `Chunker`, MiniLM embedding,
Qdrant storage and search, collection versions.

Each (tenant, collection) is its own Qdrant collection. A chunk's point id is uuid5 of
(physical collection, document id, chunk index), so re-ingesting overwrites in place; chunks a
shorter new version no longer has are deleted right after (no window where the document is
missing from search). Ingests of one document are serialised in this process (a lock per
document from the first write to that stale-chunk delete), so two ingests of it never delete
each other's chunks and the last one acknowledged is what searches find.

An ingest is bounded: the window and the chunks per document are checked before any work
(llmesh.chunking, LLMESH_MAX_CHUNKS_PER_DOCUMENT), chunks are embedded and written
LLMESH_INGEST_BATCH_CHUNKS at a time, and a cancelled or expired ingest stops between batches.

Collection versions live in Redis (llmesh.collection_versions: one atomic counter per collection
that every replica bumps and the answer cache reads). An upsert or delete bumps it before its
first write and again after its last, both before it is acknowledged, so a crash in between
still leaves a new version, and answers cached before never serve after. The `llmesh_meta`
collection keeps the last version written, as the floor of the next bump (a Redis that lost its
data resumes above it) and the version searches report while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram
from qdrant_client import models as qm
from redis import exceptions as redis_errors

from llmesh import chunking, collection_versions
from llmesh.embeddings import Embedder
from llmesh.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, PeerError, Unavailable
from llmesh.metrics import LATENCY_BUCKETS, OTHER_LABEL, BoundedLabels, trace_exemplar
from llmesh.qdrant import QdrantHandle

log = logging.getLogger("llmesh.retrieval")
tracer = trace.get_tracer("llmesh.retrieval")

META_COLLECTION = "llmesh_meta"
# Vectors from llmesh.embeddings are unit length, so the dot product is the cosine similarity;
# embedded Qdrant would renormalize every stored vector on each COSINE search.
DISTANCE = qm.Distance.DOT
POINT_NAMESPACE = uuid.UUID("6f1c3f0e-3b8a-5d7e-9a51-2f4d8c6b1e07")
DEFAULT_TOP_K = 4
MAX_TOP_K = 50
MAX_METADATA_KEYS = 32
MAX_METADATA_ENTRY_BYTES = 1024
MAX_ID_BYTES = 256
MAX_NAME_CHARS = 128
MAX_QUERY_BYTES = 16 * 1024
# Retrieval.Embed: texts per call and bytes per text.
MAX_EMBED_INPUTS = 256
MAX_EMBED_INPUT_BYTES = 16 * 1024
# Documents chunked together; the next batch is chunked while this one is embedded.
DOCS_PER_BATCH = 16
# Text an ingest has at the tokenizer at once: up to 8 small documents, a large one alone
# (each call weighs at least an eighth; the tokenizer holds a text's whole encoding meanwhile).
CHUNK_BYTES_IN_FLIGHT = 1024 * 1024
CHUNK_CONCURRENCY = 8
DEFAULT_BATCH_CHUNKS = 256
# Payload indexes: the fields searches and deletes filter on, and the first metadata keys seen
# per collection (filters name metadata keys; past this many, a key is filtered unindexed).
INDEXED_FIELDS = ("document_id", "ingest", "tenant")
MAX_INDEXED_METADATA_KEYS = 64

SEARCH_SECONDS = Histogram(
    "llmesh_retrieval_search_duration_seconds", "Retrieval search latency.", buckets=LATENCY_BUCKETS
)
POINTS = Gauge(
    "llmesh_retrieval_points",
    f"Chunks stored per collection (Qdrant's name); past LLMESH_METRICS_MAX_COLLECTIONS, the rest add up "
    f"under {OTHER_LABEL}.",
    ["collection"],
)
EMBEDDED = Counter("llmesh_retrieval_embedded_texts_total", "Texts embedded for Embed callers.")
UPSERTED = Counter("llmesh_retrieval_upserted_chunks_total", "Chunks embedded and stored.")
DOCUMENT_WAITS = Counter(
    "llmesh_retrieval_document_lock_waits_total",
    "Ingests that waited for another ingest of the same document to finish (re-ingests are serialised).",
)


@dataclass(frozen=True)
class Chunked:
    texts: list[str]
    total_tokens: int


class PointsGauge:
    """llmesh_retrieval_points with a bounded label set: collection names are the callers' own,
    so only the first `max_labels` collections updated get a series; the others' points add up
    under OTHER_LABEL (each remembered here, to replace its share when it changes)."""

    def __init__(self, max_labels: int) -> None:
        self.labels = BoundedLabels(max_labels)
        self.others: dict[str, int] = {}
        self.others_total = 0

    def set(self, physical: str, points: int) -> None:
        label = self.labels(physical)
        if label != OTHER_LABEL:
            POINTS.labels(label).set(points)
            return
        self.others_total += points - self.others.get(physical, 0)
        self.others[physical] = points
        POINTS.labels(OTHER_LABEL).set(self.others_total)


class Chunker(Protocol):
    """The tokenizer service's Chunk and Count RPCs."""

    def chunk(
        self, text: str, chunk_tokens: int, overlap_tokens: int, max_chunks: int, time_left: float
    ) -> Awaitable[Chunked]: ...

    def count(self, texts: Sequence[str], time_left: float) -> Awaitable[list[int]]: ...


@dataclass
class _Held:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class DocumentLocks:
    """A lock per (collection, document id) being ingested in this process. An entry lives while
    its lock is held or awaited, so the map holds at most the documents in flight."""

    def __init__(self, on_wait: Callable[[str, str], None]) -> None:
        self._held: dict[tuple[str, str], _Held] = {}
        self._on_wait = on_wait

    def __len__(self) -> int:
        return len(self._held)

    @contextlib.asynccontextmanager
    async def hold(self, physical: str, document_ids: Iterable[str]) -> AsyncIterator[None]:
        taken: list[tuple[str, str]] = []
        try:
            # One order for every ingest: two ingests sharing documents never wait on each other.
            for document_id in sorted(set(document_ids)):
                key = (physical, document_id)
                held = self._held.setdefault(key, _Held())
                held.users += 1
                try:
                    if held.lock.locked():
                        DOCUMENT_WAITS.inc()
                        self._on_wait(physical, document_id)
                    await held.lock.acquire()
                except BaseException:
                    self._leave(key, held)
                    raise
                taken.append(key)
            yield
        finally:
            for key in reversed(taken):
                held = self._held[key]
                held.lock.release()
                self._leave(key, held)

    def _leave(self, key: tuple[str, str], held: _Held) -> None:
        held.users -= 1
        if not held.users:
            del self._held[key]


class _ByteBudget:
    """At most `capacity` weight at once; a call waits for room (one heavier than all of it
    waits until it is alone)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def take(self, weight: int) -> AsyncIterator[None]:
        weight = min(weight, self.capacity)
        async with self._changed:
            await self._changed.wait_for(lambda: self.used + weight <= self.capacity)
            self.used += weight
        try:
            yield
        finally:
            async with self._changed:
                self.used -= weight
                self._changed.notify_all()


def _ids_of(group: list[tuple[Document, int, str]]) -> list[str]:
    return sorted({doc.id for doc, _, _ in group})[:64]


def _groups(rows: Iterable[tuple[Document, int, str]], size: int) -> Iterator[list[tuple[Document, int, str]]]:
    group: list[tuple[Document, int, str]] = []
    for row in rows:
        group.append(row)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    documents_done: int
    documents_total: int
    chunks_done: int
    done: bool = False
    collection_version: int = 0
    #: Tokens of the documents (on the last message).
    document_tokens: int = 0


@dataclass(frozen=True)
class Hit:
    document_id: str
    chunk_index: int
    text: str
    score: float
    metadata: dict[str, str]


@dataclass(frozen=True)
class Info:
    exists: bool
    points: int
    version: int
    dimension: int
    #: Vectors in an HNSW index (the rest are searched exactly).
    indexed_points: int = 0
    #: A background index build is pending or running.
    indexing: bool = False


def _clean(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]+", "_", name.lower())[:40] or "_"


def physical_name(tenant: str, collection: str) -> str:
    """Qdrant collection of (tenant, collection): readable, and unique thanks to the hash."""
    digest = hashlib.sha256(f"{tenant}\0{collection}".encode()).hexdigest()[:12]
    return f"rag_{_clean(tenant)}__{_clean(collection)}_{digest}"


def chunk_point_id(physical: str, document_id: str, index: int) -> str:
    return str(uuid.uuid5(POINT_NAMESPACE, f"{physical}/{document_id}/{index}"))


def _meta_id(physical: str) -> str:
    return str(uuid.uuid5(POINT_NAMESPACE, f"meta/{physical}"))


def _metadata_key(key: str) -> str:
    return f"metadata.{key}" if re.fullmatch(r"[A-Za-z0-9_]+", key) else f'metadata."{key}"'


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _time_left(deadline: float | None) -> float:
    """Seconds a tokenizer call of an ingest may take: what is left of its deadline."""
    return max(0.001, deadline - time.monotonic()) if deadline is not None else 60.0


async def _settled(task: asyncio.Task[Any] | None) -> None:
    """Waits for `task` to end, without its result or exception (the caller is failing already)."""
    if task is None or task.done():
        return
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" report


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded("the ingest ran past its deadline; it stopped before its next batch")


class RetrievalCore:
    def __init__(
        self,
        embedder: Embedder,
        qdrant: QdrantHandle,
        chunker: Chunker,
        *,
        chunk_tokens: int = 200,
        chunk_overlap: int = 32,
        default_collection: str = "docs",
        max_document_bytes: int = 1024 * 1024,
        versions: Any = None,
        version_prefix: str = collection_versions.PREFIX,
        max_collections_per_tenant: int = 64,
        max_metric_collections: int = 100,
        max_chunks_per_document: int = chunking.DEFAULT_MAX_CHUNKS_PER_DOCUMENT,
        batch_chunks: int = DEFAULT_BATCH_CHUNKS,
    ) -> None:
        """`versions`: the Redis (redis.asyncio) holding collection versions."""
        self.max_collections_per_tenant = max_collections_per_tenant
        self._points = PointsGauge(max_metric_collections)
        # One collection is created at a time, so two ingests cannot both take a tenant's last slot.
        self._create_lock = asyncio.Lock()
        self.max_chunks_per_document = max_chunks_per_document
        self.batch_chunks = batch_chunks
        self.documents = DocumentLocks(self._document_wait)
        #: Called (physical collection, document id) when an ingest starts waiting for another
        #: ingest of the same document (how a test sees the two serialised).
        self.on_document_wait: Callable[[str, str], None] | None = None
        self.embedder = embedder
        self.versions = versions
        self.version_prefix = version_prefix
        self.qdrant = qdrant
        self.chunker = chunker
        self.chunk_tokens = chunk_tokens
        self.chunk_overlap = chunk_overlap
        self.default_collection = default_collection
        self.max_document_bytes = max_document_bytes
        self._version_lock = asyncio.Lock()
        # Payload fields already indexed, per collection (in this process).
        self._indexed: dict[str, set[str]] = {}

    async def start(self) -> None:
        await self.qdrant.run(self._ensure_meta)

    def _document_wait(self, physical: str, document_id: str) -> None:
        if self.on_document_wait is not None:
            self.on_document_wait(physical, document_id)

    def _ensure_meta(self) -> None:
        client = self.qdrant.client
        if not client.collection_exists(META_COLLECTION):
            client.create_collection(META_COLLECTION, vectors_config=qm.VectorParams(size=1, distance=qm.Distance.DOT))
        self._ensure_indexes(META_COLLECTION, ("tenant",))  # a tenant's collections are counted by it

    # ----- names and validation

    def _physical(self, tenant: str, collection: str, prefix: str = "") -> tuple[str, str]:
        violations = []
        if len(collection) > MAX_NAME_CHARS:
            violations.append((f"{prefix}collection", f"longer than {MAX_NAME_CHARS} characters"))
        if len(tenant) > MAX_NAME_CHARS:
            violations.append((f"{prefix}tenant", f"longer than {MAX_NAME_CHARS} characters"))
        if violations:
            raise InvalidArgument(violations)
        collection = collection or self.default_collection
        return physical_name(tenant, collection), collection

    def validate_upsert(self, documents: Sequence[Document], chunk_tokens: int, overlap_tokens: int) -> tuple[int, int]:
        """Checks every document before anything is written; returns the chunk window and overlap."""
        violations: list[tuple[str, str]] = []
        if not documents:
            violations.append(("documents", "at least one document is required"))
        seen: dict[str, int] = {}
        for i, doc in enumerate(documents):
            where = f"documents[{i}]"
            if not doc.id:
                violations.append((f"{where}.id", "must not be empty"))
            elif _nbytes(doc.id) > MAX_ID_BYTES:
                violations.append((f"{where}.id", f"longer than {MAX_ID_BYTES} bytes"))
            elif doc.id in seen:
                violations.append((f"{where}.id", f"duplicate of documents[{seen[doc.id]}].id"))
            else:
                seen[doc.id] = i
            if not doc.text.strip():
                violations.append((f"{where}.text", "must not be empty"))
            elif _nbytes(doc.text) > self.max_document_bytes:
                violations.append((f"{where}.text", f"longer than {self.max_document_bytes} bytes"))
            if len(doc.metadata) > MAX_METADATA_KEYS:
                violations.append((f"{where}.metadata", f"at most {MAX_METADATA_KEYS} keys"))
            for key, value in doc.metadata.items():
                if not key or '"' in key or any(ord(c) < 32 for c in key):
                    violations.append((f"{where}.metadata", f"invalid key {key!r}"))
                elif _nbytes(key) + _nbytes(value) > MAX_METADATA_ENTRY_BYTES:
                    violations.append(
                        (f"{where}.metadata[{key}]", f"key and value longer than {MAX_METADATA_ENTRY_BYTES} bytes")
                    )
        chunk = chunk_tokens or self.chunk_tokens
        if overlap_tokens:
            overlap = overlap_tokens
        else:  # the default overlap, kept below a small requested window
            overlap = min(self.chunk_overlap, chunk // 4)
        violations.extend(chunking.window_violations(chunk, overlap))
        if violations:
            raise InvalidArgument(violations)
        return chunk, overlap

    # ----- upsert

    async def _refuse_too_many_chunks(
        self, documents: Sequence[Document], chunk: int, overlap: int, deadline: float | None
    ) -> None:
        """INVALID_ARGUMENT for the first document that would make more than the most chunks per
        document, before anything is written. A token covers at least one byte, so only a
        document whose bytes could make that many is counted (by the tokenizer), one at a time."""
        for i, doc in enumerate(documents):
            if chunking.chunk_count(_nbytes(doc.text), chunk, overlap) <= self.max_chunks_per_document:
                continue
            (tokens,) = await self.chunker.count([doc.text], _time_left(deadline))
            count = chunking.chunk_count(tokens, chunk, overlap)
            if count > self.max_chunks_per_document:
                raise InvalidArgument(
                    [
                        (
                            f"documents[{i}].text",
                            f"makes {count} chunks ({tokens} tokens, a window every {chunk - overlap}); "
                            f"at most {self.max_chunks_per_document}",
                        )
                    ]
                )

    async def upsert(
        self,
        collection: str,
        tenant: str,
        documents: Sequence[Document],
        chunk_tokens: int = 0,
        overlap_tokens: int = 0,
        deadline: float | None = None,
    ) -> AsyncGenerator[Progress, None]:
        """Validates everything, then chunks, embeds and stores batch by batch, yielding progress;
        the last item has done=True and the new collection version. `deadline`: time.monotonic()
        past which it stops (DEADLINE_EXCEEDED) at the next batch."""
        physical, logical = self._physical(tenant, collection)
        chunk, overlap = self.validate_upsert(documents, chunk_tokens, overlap_tokens)
        await self._refuse_too_many_chunks(documents, chunk, overlap, deadline)
        await self._admit_collection(physical, tenant, logical)
        await self.qdrant.run(self._ensure_collection, physical)
        # Before anything is written: answers cached under the old version are stale from here on,
        # even if this process dies before the end.
        await self._bump(physical, tenant, logical)
        ingest = uuid.uuid4().hex
        total = len(documents)
        batches = [(i, list(documents[i : i + DOCS_PER_BATCH])) for i in range(0, total, DOCS_PER_BATCH)]
        tokenizing = _ByteBudget(CHUNK_BYTES_IN_FLIGHT)

        async def chunk_one(doc: Document, index: int) -> Chunked:
            weight = max(_nbytes(doc.text), CHUNK_BYTES_IN_FLIGHT // CHUNK_CONCURRENCY)
            async with tokenizing.take(weight):
                try:
                    found = await self.chunker.chunk(
                        doc.text, chunk, overlap, self.max_chunks_per_document, _time_left(deadline)
                    )
                except PeerError as exc:
                    if not exc.violations():
                        raise
                    # The tokenizer names its own fields (`text`): the caller's is this document's.
                    raise InvalidArgument(
                        [(f"documents[{index}].{f}" if f else f"documents[{index}]", d) for f, d in exc.violations()]
                    ) from exc
            if not found.texts:
                raise InvalidArgument([(f"documents[{index}].text", "has no tokens")])
            return found

        async def chunk_batch(first: int, batch: list[Document]) -> list[Chunked]:
            with tracer.start_as_current_span("retrieval.chunk") as span:
                span.set_attribute("llmesh.retrieval.document_ids", [d.id for d in batch][:64])
                tasks = [asyncio.ensure_future(chunk_one(d, first + j)) for j, d in enumerate(batch)]
                try:
                    return list(await asyncio.gather(*tasks))
                except BaseException:
                    for task in tasks:
                        task.cancel()
                    raise

        done_docs = done_chunks = document_tokens = 0
        wrote = False
        pending: asyncio.Task[int] | None = None
        next_chunks: asyncio.Task[list[Chunked]] | None = asyncio.create_task(chunk_batch(*batches[0]))
        try:
            for n, (_, batch) in enumerate(batches):
                assert next_chunks is not None
                chunked = await next_chunks
                next_chunks = asyncio.create_task(chunk_batch(*batches[n + 1])) if n + 1 < len(batches) else None
                document_tokens += sum(c.total_tokens for c in chunked)
                ids = [d.id for d in batch]
                # From the existence check to the stale-chunk delete, no other ingest of these
                # documents writes: else each deletes the other's chunks as stale.
                async with self.documents.hold(physical, ids):
                    try:
                        existed = await self.qdrant.run(self._existing, physical, ids)
                        rows = (
                            (doc, index, text)
                            for doc, found in zip(batch, chunked, strict=True)
                            for index, text in enumerate(found.texts)
                        )
                        for group in _groups(rows, self.batch_chunks):
                            _check_deadline(deadline)
                            with tracer.start_as_current_span("retrieval.embed") as span:
                                span.set_attribute("llmesh.retrieval.document_ids", _ids_of(group))
                                span.set_attribute("llmesh.retrieval.chunks", len(group))
                                vectors = await self.embedder.aencode([text for _, _, text in group])
                            if pending is not None:  # the previous group is written while this one is embedded
                                done_chunks += await pending
                                yield Progress(done_docs, total, done_chunks)
                            wrote = True
                            pending = asyncio.create_task(self._write(physical, tenant, ingest, group, vectors))
                        assert pending is not None  # every document has a chunk
                        done_chunks += await pending
                        pending = None
                        if existed:
                            await self.qdrant.run(self._delete_stale, physical, ingest, existed)
                    finally:
                        # A write already on a Qdrant thread lands whatever happens to this call:
                        # the next ingest of these documents must come after it.
                        await _settled(pending)
                done_docs += len(batch)
                yield Progress(done_docs, total, done_chunks)
            version = await self._bump(physical, tenant, logical)
            wrote = False
            await self._update_points_gauge(physical)
            yield Progress(
                total, total, done_chunks, done=True, collection_version=version, document_tokens=document_tokens
            )
        finally:
            for task in (next_chunks, pending):
                if task is not None and not task.done():
                    task.cancel()
            if wrote:  # failed or cancelled part way: what was written still changes the version
                await asyncio.shield(self._bump(physical, tenant, logical))

    async def _write(
        self,
        physical: str,
        tenant: str,
        ingest: str,
        group: list[tuple[Document, int, str]],
        vectors: np.ndarray,
    ) -> int:
        points = [
            qm.PointStruct(
                id=chunk_point_id(physical, doc.id, index),
                vector=vectors[row].tolist(),
                payload={
                    "document_id": doc.id,
                    "chunk_index": index,
                    "text": text,
                    "metadata": dict(doc.metadata),
                    "tenant": tenant,
                    "ingest": ingest,
                },
            )
            for row, (doc, index, text) in enumerate(group)
        ]
        with tracer.start_as_current_span("retrieval.qdrant.upsert") as span:
            span.set_attribute("llmesh.retrieval.document_ids", _ids_of(group))
            span.set_attribute("llmesh.retrieval.chunks", len(points))
            await self.qdrant.run(self._upsert_points, physical, points)
        UPSERTED.inc(len(points))
        return len(points)

    def _upsert_points(self, physical: str, points: list[qm.PointStruct]) -> None:
        self._index_metadata(physical, points)
        self.qdrant.client.upsert(physical, points=points, wait=True)

    def _existing(self, physical: str, doc_ids: list[str]) -> list[str]:
        """The documents stored before (their chunk 0 exists): a new version may leave chunks past
        its own count, deleted after it is written."""
        firsts = {chunk_point_id(physical, d, 0): d for d in doc_ids}
        return [firsts[str(r.id)] for r in self.qdrant.client.retrieve(physical, ids=list(firsts), with_payload=False)]

    def _delete_stale(self, physical: str, ingest: str, doc_ids: list[str]) -> None:
        stale = qm.Filter(
            must=[qm.FieldCondition(key="document_id", match=qm.MatchAny(any=doc_ids))],
            must_not=[qm.FieldCondition(key="ingest", match=qm.MatchValue(value=ingest))],
        )
        self.qdrant.client.delete(physical, points_selector=qm.FilterSelector(filter=stale), wait=True)

    async def _admit_collection(self, physical: str, tenant: str, collection: str) -> None:
        """Creates a tenant's new collection, unless it holds max_collections_per_tenant already:
        every collection is held open by the embedded store and searched by name, so one key must
        not make them without bound. Refused with FAILED_PRECONDITION, not RESOURCE_EXHAUSTED:
        that one means overload, which clients retry after a delay, and this does not pass by
        itself (an operator raises LLMESH_MAX_COLLECTIONS_PER_TENANT, or the tenant ingests into a
        collection it has). Counted from the records in META_COLLECTION; replicas sharing a
        Qdrant server each check alone, so at once they may exceed it by a few."""
        if await self.qdrant.run(self.qdrant.client.collection_exists, physical):
            return
        async with self._create_lock:
            if await self.qdrant.run(self.qdrant.client.collection_exists, physical):
                return
            recorded, held = await self.qdrant.run(self._tenant_collections, physical, tenant)
            if not recorded and held >= self.max_collections_per_tenant:
                raise FailedPrecondition(
                    f"tenant {tenant!r} has {held} collections, the most LLMESH_MAX_COLLECTIONS_PER_TENANT "
                    f"({self.max_collections_per_tenant}) allows: collection {collection!r} is not created; "
                    "ingest into an existing collection",
                    reason="COLLECTION_LIMIT",
                    metadata={"limit": str(self.max_collections_per_tenant), "collections": str(held)},
                )
            # Recorded before it exists: an ingest that finds the collection finds it counted.
            if not recorded:
                await self.qdrant.run(self._record_version, physical, tenant, collection, 0)
            await self.qdrant.run(self._ensure_collection, physical)

    def _tenant_collections(self, physical: str, tenant: str) -> tuple[bool, int]:
        """Whether `physical` has a record already, and how many collections the tenant has."""
        client = self.qdrant.client
        recorded = bool(client.retrieve(META_COLLECTION, ids=[_meta_id(physical)], with_payload=False))
        of_tenant = qm.Filter(must=[qm.FieldCondition(key="tenant", match=qm.MatchValue(value=tenant))])
        return recorded, int(client.count(META_COLLECTION, count_filter=of_tenant, exact=True).count)

    def _ensure_collection(self, physical: str) -> None:
        client = self.qdrant.client
        if client.collection_exists(physical):
            size = self.qdrant.vector_size(physical)
            if size != self.embedder.dimension:
                raise FailedPrecondition(
                    f"collection holds {size}-dimensional vectors; the embedding model makes {self.embedder.dimension}",
                    reason="DIMENSION_MISMATCH",
                )
        else:
            client.create_collection(
                physical, vectors_config=qm.VectorParams(size=self.embedder.dimension, distance=DISTANCE)
            )
        # Also for collections made before these indexes existed (or migrated): idempotent.
        self._ensure_indexes(physical, INDEXED_FIELDS)

    def _ensure_indexes(self, physical: str, fields: Sequence[str]) -> None:
        done = self._indexed.setdefault(physical, set())
        for name in fields:
            if name not in done:
                self.qdrant.client.create_payload_index(physical, name, qm.PayloadSchemaType.KEYWORD)
                done.add(name)

    def _index_metadata(self, physical: str, points: list[qm.PointStruct]) -> None:
        done = self._indexed.setdefault(physical, set())
        room = MAX_INDEXED_METADATA_KEYS - sum(name.startswith("metadata.") for name in done)
        keys: dict[str, None] = {}
        for point in points:
            for key in (point.payload or {}).get("metadata") or {}:
                if re.fullmatch(r"[A-Za-z0-9_]+", key) and f"metadata.{key}" not in done:
                    keys[f"metadata.{key}"] = None
        self._ensure_indexes(physical, list(keys)[: max(0, room)])

    # ----- versions

    def _read_version(self, physical: str) -> int:
        """The last version this store recorded (the floor of the next bump)."""
        found = self.qdrant.client.retrieve(META_COLLECTION, ids=[_meta_id(physical)], with_payload=True)
        return int(found[0].payload.get("version", 0)) if found and found[0].payload else 0

    def _record_version(self, physical: str, tenant: str, collection: str, version: int) -> None:
        """Version 0: the record of a new collection, written before the collection is made."""
        if version and self._read_version(physical) >= version:
            return
        payload = {"physical": physical, "tenant": tenant, "collection": collection, "version": version}
        self.qdrant.client.upsert(
            META_COLLECTION, points=[qm.PointStruct(id=_meta_id(physical), vector=[1.0], payload=payload)], wait=True
        )

    async def _bump(self, physical: str, tenant: str, collection: str) -> int:
        """The next version, from the shared counter (distinct on every replica), also recorded here."""
        floor = await self.qdrant.run(self._read_version, physical)
        if self.versions is None:  # no shared counter (unit tests): this process alone
            async with self._version_lock:
                version = await self.qdrant.run(self._read_version, physical) + 1
                await self.qdrant.run(self._record_version, physical, tenant, collection, version)
            return version
        try:
            version = await collection_versions.bump(self.versions, tenant, collection, floor, self.version_prefix)
        except (OSError, TimeoutError, redis_errors.RedisError) as exc:
            raise Unavailable(
                f"the collection version store (Redis) is unreachable: {exc}",
                reason="VERSIONS_UNAVAILABLE",
                retry_after=1.0,
            ) from exc
        async with self._version_lock:
            await self.qdrant.run(self._record_version, physical, tenant, collection, version)
        return version

    async def _current_version(self, physical: str, tenant: str, collection: str) -> int:
        """The collection's version now: the shared counter's, or while it is unreachable the last
        recorded here."""
        if self.versions is not None:
            try:
                version = await collection_versions.read(self.versions, tenant, collection, self.version_prefix)
                if version:
                    return version
                # None there: never written, or a Redis that lost its data, which resumes at the
                # version recorded here (so retrieval and the cache agree on it).
                recorded = await self.qdrant.run(self._read_version, physical)
                if not recorded:
                    return 0
                return await collection_versions.restore(
                    self.versions, tenant, collection, recorded, self.version_prefix
                )
            except (OSError, TimeoutError, redis_errors.RedisError) as exc:
                log.warning("collection version store unreachable, reporting the recorded version: %s", exc)
        return await self.qdrant.run(self._read_version, physical)

    async def _update_points_gauge(self, physical: str) -> int:
        points = await self.qdrant.run(self._count, physical)
        self._points.set(physical, points)
        return points

    def _count(self, physical: str, flt: qm.Filter | None = None) -> int:
        if not self.qdrant.client.collection_exists(physical):
            return 0
        return int(self.qdrant.client.count(physical, count_filter=flt, exact=True).count)

    # ----- embed

    async def embed(self, inputs: Sequence[str]) -> tuple[np.ndarray, int]:
        """Unit-length vectors of `inputs` (in order) and the tokens the model read over all of
        them; INVALID_ARGUMENT naming `inputs` or `inputs[i]`."""
        violations: list[tuple[str, str]] = []
        if not inputs:
            violations.append(("inputs", "at least one text is required"))
        elif len(inputs) > MAX_EMBED_INPUTS:
            violations.append(("inputs", f"at most {MAX_EMBED_INPUTS} texts"))
        for i, text in enumerate(inputs[:MAX_EMBED_INPUTS]):
            if not text:
                violations.append((f"inputs[{i}]", "must not be empty"))
            elif _nbytes(text) > MAX_EMBED_INPUT_BYTES:
                violations.append((f"inputs[{i}]", f"longer than {MAX_EMBED_INPUT_BYTES} bytes"))
        if violations:
            raise InvalidArgument(violations)
        with tracer.start_as_current_span("retrieval.embed") as span:
            span.set_attribute("llmesh.embed.inputs", len(inputs))
            vectors = await self.embedder.aencode(list(inputs))
            tokens = sum(await self.embedder.acount_tokens(list(inputs)))
            span.set_attribute("llmesh.embed.input_tokens", tokens)
        EMBEDDED.inc(len(inputs))
        return vectors, tokens

    @property
    def embedding_model(self) -> str:
        """The embedding model's name: its id without the organisation ("all-MiniLM-L6-v2")."""
        return self.embedder.model_id.rsplit("/", 1)[-1]

    # ----- search

    async def search(
        self,
        query: str,
        collection: str,
        tenant: str,
        top_k: int = 0,
        score_threshold: float = 0.0,
        filters: Mapping[str, str] | None = None,
    ) -> tuple[list[Hit], int]:
        started = time.perf_counter()
        violations = []
        if not query.strip():
            violations.append(("query", "must not be empty"))
        elif _nbytes(query) > MAX_QUERY_BYTES:
            violations.append(("query", f"longer than {MAX_QUERY_BYTES} bytes"))
        if top_k > MAX_TOP_K:
            violations.append(("top_k", f"at most {MAX_TOP_K}"))
        if not -1.0 <= score_threshold <= 1.0:
            violations.append(("score_threshold", "must be a cosine similarity in [-1, 1]"))
        for key in filters or {}:
            if not key or '"' in key:
                violations.append(("filter", f"invalid metadata key {key!r}"))
        if violations:
            raise InvalidArgument(violations)
        physical, logical = self._physical(tenant, collection)
        limit = top_k or DEFAULT_TOP_K
        # Read before the points: an ingest landing during the search makes what it found stale.
        version = await self._current_version(physical, tenant, logical)
        with tracer.start_as_current_span("retrieval.embed"):
            vector = (await self.embedder.aencode([query]))[0]
        with tracer.start_as_current_span("retrieval.qdrant.search") as span:
            hits = await self.qdrant.run(
                self._search, physical, vector, limit, score_threshold or None, dict(filters or {})
            )
            span.set_attribute("llmesh.retrieval.document_ids", [h.document_id for h in hits])
            span.set_attribute("llmesh.retrieval.scores", [round(h.score, 4) for h in hits])
        SEARCH_SECONDS.observe(time.perf_counter() - started, exemplar=trace_exemplar())
        return hits, version

    def _search(
        self, physical: str, vector: np.ndarray, limit: int, threshold: float | None, filters: dict[str, str]
    ) -> list[Hit]:
        client = self.qdrant.client
        if not client.collection_exists(physical):
            return []
        flt = None
        if filters:
            flt = qm.Filter(
                must=[qm.FieldCondition(key=_metadata_key(k), match=qm.MatchValue(value=v)) for k, v in filters.items()]
            )
        found = client.query_points(
            physical, query=vector.tolist(), query_filter=flt, limit=limit, score_threshold=threshold, with_payload=True
        ).points
        hits = [
            Hit(
                document_id=str(p.payload.get("document_id", "")),
                chunk_index=int(p.payload.get("chunk_index", 0)),
                text=str(p.payload.get("text", "")),
                score=max(-1.0, min(1.0, float(p.score))),
                metadata={str(k): str(v) for k, v in (p.payload.get("metadata") or {}).items()},
            )
            for p in found
            if p.payload
        ]
        return hits

    # ----- delete and info

    async def delete(self, collection: str, tenant: str, document_ids: Sequence[str]) -> tuple[int, int]:
        violations = []
        if not document_ids:
            violations.append(("document_ids", "at least one document id is required"))
        for i, doc_id in enumerate(document_ids):
            if not doc_id:
                violations.append((f"document_ids[{i}]", "must not be empty"))
        if violations:
            raise InvalidArgument(violations)
        physical, logical = self._physical(tenant, collection)
        if not await self.qdrant.run(self.qdrant.client.collection_exists, physical):
            return 0, await self._current_version(physical, tenant, logical)
        await self._bump(physical, tenant, logical)  # before the delete, as for an upsert
        unique = list(dict.fromkeys(document_ids))
        # After an ingest of these documents that is under way, not between its writes.
        async with self.documents.hold(physical, unique):
            with tracer.start_as_current_span("retrieval.qdrant.delete") as span:
                span.set_attribute("llmesh.retrieval.document_ids", list(document_ids)[:64])
                deleted, _ = await self.qdrant.run(self._delete_docs, physical, unique)
        version = await self._bump(physical, tenant, logical)
        await self._update_points_gauge(physical)
        return deleted, version

    def _delete_docs(self, physical: str, document_ids: list[str]) -> tuple[int, bool]:
        client = self.qdrant.client
        if not client.collection_exists(physical):
            return 0, False
        flt = qm.Filter(must=[qm.FieldCondition(key="document_id", match=qm.MatchAny(any=document_ids))])
        deleted = int(client.count(physical, count_filter=flt, exact=True).count)
        if deleted:
            client.delete(physical, points_selector=qm.FilterSelector(filter=flt), wait=True)
        return deleted, True

    async def info(self, collection: str, tenant: str) -> Info:
        physical, logical = self._physical(tenant, collection)
        version = await self._current_version(physical, tenant, logical)
        info = await self.qdrant.run(self._info, physical, version)
        if info.exists:
            self._points.set(physical, info.points)
        return info

    def _info(self, physical: str, version: int) -> Info:
        if not self.qdrant.client.collection_exists(physical):
            return Info(False, 0, version, 0)
        indexed, indexing = self.qdrant.index_state(physical)
        return Info(True, self._count(physical), version, self.qdrant.vector_size(physical), indexed, indexing)
