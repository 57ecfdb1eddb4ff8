"""The gateway's view of its downstream services: typed calls over the stubs, each with the
request's remaining deadline, errors turned into domain errors naming the peer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from llmesh.channels import peer_channel
from llmesh.errors import LlmeshError, from_rpc_error
from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

T = TypeVar("T")
# Cache and metadata lookups are cheap; past this the gateway goes on without them.
CACHE_TIMEOUT_S = 2.0


@dataclass
class Deadline:
    """Absolute deadline of one gateway request; every downstream call gets what is left."""

    expires_at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.001, self.expires_at - time.monotonic())


class PeerCallError(LlmeshError):
    """Raised for a failed downstream call; `cause` keeps the peer's status for relaying."""

    def __init__(self, cause: LlmeshError) -> None:
        super().__init__(cause.message, reason=cause.reason, metadata=cause.metadata)
        self.cause = cause
        self.code = cause.code

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        return self.cause.trailing_metadata()


async def _unary(peer: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise PeerCallError(from_rpc_error(peer, err)) from err


async def _stream(peer: str, call: Any) -> AsyncIterator[Any]:
    try:
        async for message in call:
            yield message
    except grpc.aio.AioRpcError as err:
        raise PeerCallError(from_rpc_error(peer, err)) from err
    finally:
        # Our caller went away (or we failed): cancel downstream now, freeing its resources.
        call.cancel()


class Peers:
    def __init__(self, tokenizer: str, inference: str, cache: str, retrieval: str, max_message_bytes: int) -> None:
        self.channels = {
            name: peer_channel(target, max_message_bytes)
            for name, target in (
                ("tokenizer", tokenizer), ("inference", inference), ("cache", cache), ("retrieval", retrieval),
            )
        }
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.channels["tokenizer"])
        self.inference = inference_pb2_grpc.InferenceStub(self.channels["inference"])
        self.cache = cache_pb2_grpc.CacheStub(self.channels["cache"])
        self.retrieval = retrieval_pb2_grpc.RetrievalStub(self.channels["retrieval"])

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    # Each call relays the peer's status as a domain error naming the peer.
    async def chat_template(
        self, messages: list[common_pb2.ChatMessage], deadline: Deadline
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        request = tokenizer_pb2.ApplyChatTemplateRequest(messages=messages, add_generation_prompt=True, tokenize=True)
        return await _unary("tokenizer", self.tokenizer.ApplyChatTemplate(request, timeout=deadline.remaining()))

    async def model_info(self, deadline: Deadline) -> inference_pb2.ModelInfo:
        request = inference_pb2.GetModelInfoRequest()
        return await _unary("inference", self.inference.GetModelInfo(request, timeout=deadline.remaining()))

    def generate(
        self, ids: list[int], sampling: common_pb2.SamplingParams, request_id: str, deadline: Deadline
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        request = inference_pb2.InferenceRequest(
            token_ids=inference_pb2.TokenIds(ids=ids), sampling=sampling, request_id=request_id
        )
        return _stream("inference", self.inference.Generate(request, timeout=deadline.remaining()))

    async def cache_lookup(
        self, request: cache_pb2.CacheLookupRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupResponse:
        return await _unary("cache", self.cache.Lookup(request, timeout=min(deadline.remaining(), CACHE_TIMEOUT_S)))

    async def cache_store(
        self, request: cache_pb2.CacheStoreRequest, deadline: Deadline
    ) -> cache_pb2.CacheStoreResponse:
        return await _unary("cache", self.cache.Store(request, timeout=min(deadline.remaining(), CACHE_TIMEOUT_S)))

    async def collection_info(self, collection: str, tenant: str, deadline: Deadline) -> retrieval_pb2.CollectionInfo:
        request = retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=tenant)
        return await _unary(
            "retrieval", self.retrieval.GetCollectionInfo(request, timeout=min(deadline.remaining(), CACHE_TIMEOUT_S))
        )

    async def search(
        self, request: retrieval_pb2.RetrievalSearchRequest, deadline: Deadline
    ) -> retrieval_pb2.RetrievalSearchResponse:
        return await _unary("retrieval", self.retrieval.Search(request, timeout=deadline.remaining()))

    def upsert(
        self, request: retrieval_pb2.UpsertRequest, deadline: Deadline
    ) -> AsyncIterator[retrieval_pb2.UpsertProgress]:
        return _stream("retrieval", self.retrieval.Upsert(request, timeout=deadline.remaining()))
