"""The gateway's view of its downstream services: typed calls over the stubs, each with the
request's remaining deadline, errors turned into domain errors naming the peer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
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
from services.gateway.breaker import BreakerConfig, CircuitBreaker, TransitionListener

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


# Codes that say the downstream is unhealthy; others (bad input, overload pushback) are its
# healthy answers and do not count against its breaker.
BREAKER_FAILURE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)


def counts_as_failure(exc: BaseException) -> bool:
    return isinstance(exc, PeerCallError) and exc.code in BREAKER_FAILURE_CODES


async def _unary(breaker: CircuitBreaker, call: Callable[[], Awaitable[T]]) -> T:
    async with breaker.guard():
        try:
            return await call()
        except grpc.aio.AioRpcError as err:
            raise PeerCallError(from_rpc_error(breaker.name, err)) from err


async def _stream(breaker: CircuitBreaker, start: Callable[[], Any]) -> AsyncIterator[Any]:
    async with breaker.guard():
        call = start()
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as err:
            raise PeerCallError(from_rpc_error(breaker.name, err)) from err
        finally:
            # Our caller went away (or we failed): cancel downstream now, freeing its resources.
            call.cancel()


PEERS = ("tokenizer", "inference", "cache", "retrieval")


class Peers:
    """Stubs to the four downstreams, each behind its own circuit breaker."""

    def __init__(
        self,
        targets: Mapping[str, str],
        max_message_bytes: int,
        breaker_config: BreakerConfig | None = None,
        on_transition: Callable[[str], TransitionListener] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.channels = {name: peer_channel(targets[name], max_message_bytes, credentials) for name in PEERS}
        self.breakers = {
            name: CircuitBreaker(
                name,
                breaker_config,
                is_failure=counts_as_failure,
                on_transition=[on_transition(name)] if on_transition else None,
            )
            for name in PEERS
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
        return await _unary(
            self.breakers["tokenizer"], lambda: self.tokenizer.ApplyChatTemplate(request, timeout=deadline.remaining())
        )

    async def model_info(self, deadline: Deadline) -> inference_pb2.ModelInfo:
        request = inference_pb2.GetModelInfoRequest()
        return await _unary(
            self.breakers["inference"], lambda: self.inference.GetModelInfo(request, timeout=deadline.remaining())
        )

    def generate(
        self, prompt: list[int] | str, sampling: common_pb2.SamplingParams, request_id: str, deadline: Deadline
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        """Token ids normally; rendered text when the tokenizer is down (inference tokenizes it)."""
        request = inference_pb2.InferenceRequest(sampling=sampling, request_id=request_id)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return _stream(
            self.breakers["inference"], lambda: self.inference.Generate(request, timeout=deadline.remaining())
        )

    async def cache_lookup(
        self, request: cache_pb2.CacheLookupRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupResponse:
        return await _unary(
            self.breakers["cache"],
            lambda: self.cache.Lookup(request, timeout=min(deadline.remaining(), CACHE_TIMEOUT_S)),
        )

    async def cache_store(
        self, request: cache_pb2.CacheStoreRequest, deadline: Deadline
    ) -> cache_pb2.CacheStoreResponse:
        return await _unary(
            self.breakers["cache"],
            lambda: self.cache.Store(request, timeout=min(deadline.remaining(), CACHE_TIMEOUT_S)),
        )

    async def collection_info(self, collection: str, tenant: str, deadline: Deadline) -> retrieval_pb2.CollectionInfo:
        request = retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=tenant)
        return await _unary(
            self.breakers["retrieval"],
            lambda: self.retrieval.GetCollectionInfo(request, timeout=min(deadline.remaining(), CACHE_TIMEOUT_S)),
        )

    async def search(
        self, request: retrieval_pb2.RetrievalSearchRequest, deadline: Deadline
    ) -> retrieval_pb2.RetrievalSearchResponse:
        return await _unary(
            self.breakers["retrieval"], lambda: self.retrieval.Search(request, timeout=deadline.remaining())
        )

    def upsert(
        self, request: retrieval_pb2.UpsertRequest, deadline: Deadline
    ) -> AsyncIterator[retrieval_pb2.UpsertProgress]:
        return _stream(self.breakers["retrieval"], lambda: self.retrieval.Upsert(request, timeout=deadline.remaining()))
