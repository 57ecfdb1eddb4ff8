"""gRPC side of the retrieval service: messages in, RetrievalCore calls, messages out; chunking
goes to the tokenizer service over a peer channel, within the caller's deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import grpc

from llmesh import collection_versions, errors, redis_server
from llmesh import qdrant as qdrant_mod
from llmesh.channels import PeerAccess, peer_access, peer_channel, remaining_seconds
from llmesh.embeddings import Embedder
from llmesh.server import Readiness
from llmesh.settings import RetrievalServiceSettings
from llmesh.v1 import common_pb2, retrieval_pb2, retrieval_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.retrieval.core import Chunked, Document, RetrievalCore

# Time an upsert may take when its caller set no deadline.
DEFAULT_UPSERT_SECONDS = 600.0


class TokenizerChunker:
    """`Chunker` backed by the tokenizer service's Chunk and Count RPCs."""

    def __init__(self, target: str, max_message_bytes: int, access: PeerAccess | None = None) -> None:
        self.channel = peer_channel(target, max_message_bytes, access)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)

    async def chunk(
        self, text: str, chunk_tokens: int, overlap_tokens: int, max_chunks: int, time_left: float
    ) -> Chunked:
        request = tokenizer_pb2.ChunkRequest(
            text=text, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens, max_chunks=max_chunks
        )
        try:
            response = await self.stub.Chunk(request, timeout=time_left)
        except grpc.aio.AioRpcError as err:
            raise errors.from_rpc_error("tokenizer", err) from err
        return Chunked([c.text for c in response.chunks], response.total_tokens)

    async def count(self, texts: Sequence[str], time_left: float) -> list[int]:
        try:
            response = await self.stub.Count(tokenizer_pb2.CountRequest(texts=texts), timeout=time_left)
        except grpc.aio.AioRpcError as err:
            raise errors.from_rpc_error("tokenizer", err) from err
        return list(response.counts)

    async def close(self) -> None:
        await self.channel.close()


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServicer):
    def __init__(self, core: Readiness[RetrievalCore]) -> None:
        self._core = core

    @property
    def core(self) -> RetrievalCore:
        return self._core.get()

    async def Upsert(self, request, context):  # type: ignore[no-untyped-def]
        core = self.core
        deadline = time.monotonic() + remaining_seconds(context, DEFAULT_UPSERT_SECONDS)
        documents = [Document(d.id, d.text, dict(d.metadata)) for d in request.documents]
        # Closed here whatever ends the call (a cancelled one too): its document locks and tasks
        # go with it, not whenever the generator is collected.
        async with contextlib.aclosing(
            core.upsert(
                request.collection, request.tenant, documents, request.chunk_tokens, request.overlap_tokens, deadline
            )
        ) as progresses:
            async for progress in progresses:
                yield retrieval_pb2.UpsertProgress(
                    documents_done=progress.documents_done,
                    documents_total=progress.documents_total,
                    chunks_done=progress.chunks_done,
                    done=progress.done,
                    collection_version=progress.collection_version,
                    document_tokens=progress.document_tokens,
                )

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        hits, version = await self.core.search(
            request.query,
            request.collection,
            request.tenant,
            request.top_k,
            request.score_threshold,
            dict(request.filter),
        )
        return retrieval_pb2.RetrievalSearchResponse(
            results=[
                common_pb2.ScoredChunk(
                    document_id=h.document_id,
                    chunk_index=h.chunk_index,
                    text=h.text,
                    score=h.score,
                    metadata=h.metadata,
                )
                for h in hits
            ],
            collection_version=version,
        )

    async def Delete(self, request, context):  # type: ignore[no-untyped-def]
        deleted, version = await self.core.delete(request.collection, request.tenant, list(request.document_ids))
        return retrieval_pb2.DeleteResponse(deleted_chunks=deleted, collection_version=version)

    async def GetCollectionInfo(self, request, context):  # type: ignore[no-untyped-def]
        info = await self.core.info(request.collection, request.tenant)
        return retrieval_pb2.CollectionInfo(
            exists=info.exists,
            points=info.points,
            version=info.version,
            dimension=info.dimension,
            indexed_points=info.indexed_points,
            indexing=info.indexing,
        )

    async def Embed(self, request, context):  # type: ignore[no-untyped-def]
        core = self.core
        vectors, tokens = await core.embed(list(request.inputs))
        return retrieval_pb2.RetrievalEmbedResponse(
            vectors=[retrieval_pb2.FloatVector(values=row.tolist()) for row in vectors],
            model=core.embedding_model,
            input_tokens=tokens,
        )


class RetrievalApp:
    service_names: Sequence[str] = (retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"].full_name,)

    def __init__(self, settings: RetrievalServiceSettings, *, version_prefix: str = collection_versions.PREFIX) -> None:
        """`version_prefix`: where collection versions live in Redis (tests keep theirs apart)."""
        self.settings = settings
        self.version_prefix = version_prefix
        self.core: Readiness[RetrievalCore] = Readiness()
        self._embedder: Embedder | None = None
        self._qdrant: qdrant_mod.QdrantHandle | None = None
        self._chunker: TokenizerChunker | None = None
        self._versions: Any = None

    def register(self, server: grpc.aio.Server) -> None:
        retrieval_pb2_grpc.add_RetrievalServicer_to_server(RetrievalServicer(self.core), server)

    async def start(self) -> None:
        s = self.settings
        self._embedder = await asyncio.to_thread(
            Embedder.load, s.runtime.models_path, s.store.embedding_model, dtype=s.store.embedding_dtype
        )
        await self._embedder.aencode(["warm up"])
        self._qdrant = await asyncio.to_thread(qdrant_mod.open_client, s, "retrieval")
        self._chunker = TokenizerChunker(s.tokenizer_peer.target, s.runtime.max_message_bytes, peer_access(s.runtime))
        # Collection versions: the mesh's Redis (the cache's), shared by every replica.
        self._versions = collection_versions.connect(
            redis_server.resolve_url(s.store.redis_url, s), s.store.redis_timeout_seconds
        )
        core = RetrievalCore(
            self._embedder,
            self._qdrant,
            self._chunker,
            chunk_tokens=s.retrieval.chunk_tokens,
            chunk_overlap=s.retrieval.chunk_overlap,
            default_collection=s.collections.default_collection,
            max_document_bytes=s.retrieval.max_document_bytes,
            versions=self._versions,
            version_prefix=self.version_prefix,
            max_collections_per_tenant=s.retrieval.max_collections_per_tenant,
            max_metric_collections=s.retrieval.metrics_max_collections,
            max_chunks_per_document=s.chunk_limits.max_chunks_per_document,
            batch_chunks=s.retrieval.ingest_batch_chunks,
        )
        await core.start()
        self.core.set(core)

    def health_details(self) -> dict[str, bool]:
        """`llmesh.v1.Retrieval/qdrant` in the health service: NOT_SERVING while the last Qdrant
        call got no reply."""
        return {"qdrant": self._qdrant is not None and self._qdrant.reachable}

    async def stop(self) -> None:
        self.core.clear()
        if self._chunker is not None:
            await self._chunker.close()
        if self._versions is not None:
            await self._versions.aclose()
        if self._qdrant is not None:
            await asyncio.to_thread(self._qdrant.close)
        if self._embedder is not None:
            self._embedder.close()
