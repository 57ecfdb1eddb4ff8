"""The gateway's downstreams, one `Upstream` each (services/gateway/upstream.py): typed calls
over the stubs, each with the request's remaining deadline, errors turned into domain errors
naming the peer. `Peers` builds the upstreams and routes each call to its owner; it keeps no
view of a downstream's health of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from llmesh.channels import PeerAccess, peer_channel
from llmesh.v1 import (
    cache_pb2,
    common_pb2,
    inference_pb2,
    retrieval_pb2,
    tokenizer_pb2,
)
from services.gateway.breaker import BreakerConfig, CircuitBreaker, TransitionListener
from services.gateway.deadline import Deadline
from services.gateway.hop_errors import PeerCallError
from services.gateway.routing import ReplicaRouter
from services.gateway.upstream import (
    EMBED,
    INFO,
    INGEST,
    SEARCH,
    CacheUpstream,
    Guard,
    HopBudgets,
    InferenceUpstream,
    RetrievalUpstream,
    TokenizerUpstream,
    Upstream,
    breaker_labels,
    channel_of,
    counts_as_failure,
    inference_peer,
    method_breaker,
)

if TYPE_CHECKING:
    from services.gateway.admission.load import LoadBook
    from services.gateway.replicas import RoutingConfig

__all__ = [
    "EMBED",
    "INFO",
    "INGEST",
    "PEERS",
    "SEARCH",
    "Deadline",
    "HopBudgets",
    "PeerCallError",
    "Peers",
    "breaker_labels",
    "channel_of",
    "counts_as_failure",
    "inference_peer",
    "method_breaker",
]

PEERS = ("tokenizer", "inference", "cache", "retrieval")


class Breakers(Mapping[str, CircuitBreaker]):
    """Every upstream's breakers by name (`cache`, `retrieval:ingest`, `inference/NAME:info`):
    a read-only view, each breaker owned by its upstream."""

    def __init__(self, upstreams: Callable[[], Sequence[Upstream]]) -> None:
        self._upstreams = upstreams

    def __getitem__(self, name: str) -> CircuitBreaker:
        for upstream in self._upstreams():
            found = upstream.breakers.get(name)
            if found is not None:
                return found
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        for upstream in self._upstreams():
            yield from upstream.breakers

    def __len__(self) -> int:
        return sum(len(u.breakers) for u in self._upstreams())


class Peers:
    """The four downstreams, one `Upstream` each, and one per inference model (`models`: name
    -> target; by default the one unnamed model at targets["inference"]); every call gets the
    smaller of the request's remaining deadline and its hop's budget, through its upstream's
    breaker. `probe_seconds`: how often an upstream whose breaker is open is health-checked
    (0: never; see `Upstream`)."""

    def __init__(
        self,
        targets: Mapping[str, str],
        max_message_bytes: int,
        breaker_config: BreakerConfig | None = None,
        on_transition: Callable[[str], TransitionListener] | None = None,
        access: PeerAccess | None = None,
        budgets: HopBudgets | None = None,
        models: Mapping[str, str] | None = None,
        probe_seconds: float = 0.25,
        routing: RoutingConfig | None = None,
        loads: LoadBook | None = None,
        multiplex: bool = True,
    ) -> None:
        self.budgets = budgets or HopBudgets()
        self.probe_seconds = probe_seconds
        models = models or {"": targets["inference"]}
        guard = Guard(breaker_config, on_transition, probe_seconds)

        def channel(name: str) -> grpc.aio.Channel:
            return peer_channel(targets[name], max_message_bytes, access)

        self.tokenizer = TokenizerUpstream(channel("tokenizer"), self.budgets.tokenizer, guard)
        self.cache = CacheUpstream(channel("cache"), self.budgets.cache_lookup, self.budgets.cache_store, guard)
        self.retrieval = RetrievalUpstream(channel("retrieval"), self.budgets, guard)
        self.models = {
            model: InferenceUpstream(
                model,
                target,
                max_message_bytes,
                access,
                guard,
                self.budgets.collection_info,
                routing,
                loads,
                multiplex,
            )
            for model, target in models.items()
        }
        self.breakers = Breakers(self.upstreams)

    def upstreams(self) -> list[Upstream]:
        return [self.tokenizer, self.cache, self.retrieval, *self.models.values()]

    def model(self, model: str) -> InferenceUpstream:
        """The upstream of a model's inference (a route name; "" the unnamed model)."""
        return self.models[model]

    @property
    def routers(self) -> dict[str, ReplicaRouter]:
        """The replica routers of the models served by several replicas (each its upstream's)."""
        return {model: u.router for model, u in self.models.items() if u.router is not None}

    async def start(self) -> None:
        """Starts what the upstreams run in the background: the replica routers' health checks,
        load watches and DNS refreshes, and the single-replica models' load watches."""
        for upstream in self.upstreams():
            await upstream.start()

    async def close(self) -> None:
        for upstream in self.upstreams():
            await upstream.close()

    # Each call relays the peer's status as a domain error naming the peer.
    async def chat_template(
        self,
        messages: list[common_pb2.ChatMessage],
        deadline: Deadline,
        model: str = "",
        tools: Sequence[common_pb2.Tool] = (),
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        """`model`: whose tokenizer ("" = the tokenizer service's default); `tools`: the
        functions the model may call (automatic tool choice)."""
        return await self.tokenizer.chat_template(messages, deadline, model, tools)

    async def encode(self, text: str, deadline: Deadline, model: str = "") -> tokenizer_pb2.EncodeResponse:
        """A raw prompt's token ids, with the special tokens the model's tokenizer adds to a
        text (its BOS, if it has one). `model`: whose tokenizer ("" = the default)."""
        return await self.tokenizer.encode(text, deadline, model)

    async def get_chat_template(self, deadline: Deadline, model: str = "") -> tokenizer_pb2.GetChatTemplateResponse:
        """The model's chat template itself (`model`: whose tokenizer, "" = the default)."""
        return await self.tokenizer.get_chat_template(deadline, model)

    async def model_info(self, deadline: Deadline, model: str = "") -> inference_pb2.ModelInfo:
        return await self.models[model].model_info(deadline)

    def generate(
        self,
        prompt: list[int] | str,
        sampling: common_pb2.SamplingParams,
        request_id: str,
        deadline: Deadline,
        model: str = "",
        response_format: common_pb2.ResponseFormat | None = None,
        priority: int = 0,
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        """Token ids normally; rendered text when the tokenizer is down (inference tokenizes it).
        `model`: whose inference service (a key of `models`); `response_format`: the form the
        answer must take (None: free text); `priority`: the engine's (0 interactive, 1 batch)."""
        request = inference_pb2.InferenceRequest(sampling=sampling, request_id=request_id, priority=priority)
        if response_format is not None:
            request.response_format.CopyFrom(response_format)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return self.models[model].generate(request, deadline)

    def watch_load(self, model: str = "") -> AsyncIterator[inference_pb2.LoadReport]:
        """The model's inference load reports (see `InferenceUpstream.watch_load`)."""
        return self.models[model].watch_load()

    async def cache_lookup(
        self, request: cache_pb2.CacheLookupRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupResponse:
        return await self.cache.lookup(request, deadline)

    async def cache_store(
        self, request: cache_pb2.CacheStoreRequest, deadline: Deadline
    ) -> cache_pb2.CacheStoreResponse:
        return await self.cache.store(request, deadline)

    async def cache_invalidate(
        self, request: cache_pb2.InvalidateRequest, deadline: Deadline
    ) -> cache_pb2.InvalidateResponse:
        """An admin purge: the caller's whole deadline (not an optional hop)."""
        return await self.cache.invalidate(request, deadline)

    async def collection_info(self, collection: str, tenant: str, deadline: Deadline) -> retrieval_pb2.CollectionInfo:
        return await self.retrieval.collection_info(collection, tenant, deadline)

    async def search(
        self, request: retrieval_pb2.RetrievalSearchRequest, deadline: Deadline, optional: bool = True
    ) -> retrieval_pb2.RetrievalSearchResponse:
        """`optional`: context for a generation (the search budget applies); else the caller's own
        search (its whole deadline)."""
        return await self.retrieval.search(request, deadline, optional)

    async def embed(
        self, request: retrieval_pb2.RetrievalEmbedRequest, deadline: Deadline, budget: float | None = None
    ) -> retrieval_pb2.RetrievalEmbedResponse:
        """A caller's embeddings (its own breaker, so a burst of them never opens the RAG hop's);
        `budget`: a bound below the caller's deadline (None: the whole deadline)."""
        return await self.retrieval.embed(request, deadline, budget)

    def upsert(
        self, request: retrieval_pb2.UpsertRequest, deadline: Deadline
    ) -> AsyncIterator[retrieval_pb2.UpsertProgress]:
        return self.retrieval.upsert(request, deadline)
