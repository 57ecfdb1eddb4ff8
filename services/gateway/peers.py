"""The gateway's view of its downstream services: typed calls over the stubs, each with the
request's remaining deadline, errors turned into domain errors naming the peer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh import tasks
from llmesh.channels import PeerAccess, peer_channel
from llmesh.errors import LlmeshError, from_rpc_error
from llmesh.settings import HopBudgetSettings
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
from services.gateway.breaker import BreakerConfig, CircuitBreaker, Permit, State, TransitionListener
from services.gateway.deadline import CallerDeadline, Deadline
from services.gateway.hop_errors import BREAKER_FAILURE_CODES, PeerCallError
from services.gateway.lookups import LookupCoalescer
from services.gateway.multiplex import GenerationMux
from services.gateway.routing import ReplicaRouter, routed

if TYPE_CHECKING:
    from services.gateway.admission.load import LoadBook
    from services.gateway.replicas import RoutingConfig

T = TypeVar("T")


@dataclass(frozen=True)
class HopBudgets:
    """Seconds each optional hop may take before the gateway goes on without it (as when the
    service is down). Inference has none: it keeps the caller's deadline, and its breaker judges
    the time to first token and the stalls between tokens (`BreakerConfig.slow_call_duration`)."""

    cache_lookup: float = 0.25
    cache_store: float = 0.5
    collection_info: float = 0.25
    search: float = 1.0
    tokenizer: float = 0.25

    @classmethod
    def from_settings(cls, settings: HopBudgetSettings) -> HopBudgets:
        """From the gateway's LLMESH_HOP_* settings."""
        return cls(
            cache_lookup=settings.cache_lookup_seconds,
            cache_store=settings.cache_store_seconds,
            collection_info=settings.collection_info_seconds,
            search=settings.search_seconds,
            tokenizer=settings.tokenizer_seconds,
        )


def counts_as_failure(exc: BaseException) -> bool:
    return isinstance(exc, PeerCallError) and exc.code in BREAKER_FAILURE_CODES


async def _unary(
    breaker: CircuitBreaker, call: Callable[[float], Awaitable[T]], deadline: Deadline, budget: float | None = None
) -> T:
    """One unary call with min(the caller's remaining deadline, the hop's budget). The breaker
    hears the hop's own errors and timeouts; the caller's spent deadline or cancellation gives
    no verdict (`CallerDeadline` is raised instead of a peer error)."""
    remaining = deadline.check(breaker.name)
    caller_bound = budget is None or remaining <= budget
    permit = breaker.acquire()
    try:
        result = await call(remaining if caller_bound else budget)  # type: ignore[arg-type]
    except grpc.aio.AioRpcError as err:
        raise _judge(permit, breaker.name, err, caller_bound, deadline) from err
    except BaseException:
        permit.release()
        raise
    permit.success()
    return result


def _judge(permit: Permit, name: str, err: grpc.aio.AioRpcError, caller_bound: bool, deadline: Deadline) -> LlmeshError:
    """Reports a failed call to the breaker and returns the error to raise."""
    if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) and (
        caller_bound or deadline.remaining() <= 0
    ):
        permit.release()  # the caller's deadline, not the hop's: no verdict
        return CallerDeadline(f"{name}: the request's deadline ran out")
    error = PeerCallError(from_rpc_error(name, err))
    if counts_as_failure(error):
        permit.failure()
    else:
        permit.success()  # e.g. INVALID_ARGUMENT, RESOURCE_EXHAUSTED: the downstream answered
    return error


async def _stream(breaker: CircuitBreaker, start: Callable[[float], Any], deadline: Deadline) -> AsyncIterator[Any]:
    """A server stream with the caller's deadline. The breaker judges the hop by its time to first
    message and the longest stall between messages, not by the stream's length: a wait past
    `slow_call_duration` is reported slow at once (while the call goes on), so a frozen service is
    cut off after the breaker's minimum calls; a half-open trial is decided by its first message."""
    remaining = deadline.check(breaker.name)
    permit = breaker.acquire()
    slow_after = breaker.config.slow_call_duration
    loop = asyncio.get_running_loop()
    call = start(remaining)
    last = loop.time()
    worst = 0.0
    timer: asyncio.TimerHandle | None = None

    def watch() -> None:
        # Due `slow_after` past the last message as it was when armed; a message since moves it
        # on (one timer per stall, not one per message: messages are tokens).
        nonlocal timer
        quiet = loop.time() - last
        if quiet < slow_after:
            timer = loop.call_at(last + slow_after, watch)
        else:
            timer = None  # the next message watches again
            permit.success(quiet)

    timer = loop.call_at(last + slow_after, watch)
    try:
        async for message in call:
            now = loop.time()
            worst = max(worst, now - last)
            last = now
            if timer is None:
                timer = loop.call_at(now + slow_after, watch)
            if permit.trial:
                permit.success(worst)
            yield message
        permit.success(worst)
    except grpc.aio.AioRpcError as err:
        raise _judge(permit, breaker.name, err, True, deadline) from err
    finally:
        if timer is not None:
            timer.cancel()
        permit.release()  # no verdict yet (cancelled, or our caller went away): none is given
        # Our caller went away (or we failed): cancel downstream now, freeing its resources.
        call.cancel()


PEERS = ("tokenizer", "inference", "cache", "retrieval")
# Breakers per peer and method where the calls differ: a cheap call (model info)
# never spends the Generate breaker's half-open trials nor closes it while Generate fails; an
# Ingest, or a caller's own Search, never opens the breaker the RAG hop relies on. Named
# "<peer>:<method>"; the peer's own name is the breaker of its main calls.
INFO = "info"
INGEST = "ingest"
SEARCH = "search"
EMBED = "embed"


def method_breaker(peer: str, method: str) -> str:
    return f"{peer}:{method}"


def channel_of(breaker: str) -> str:
    """The channel (peer) a breaker's calls go to."""
    return breaker.partition(":")[0]


def breaker_labels(breaker: str) -> tuple[str, str, str]:
    """(service, model, method) of a breaker's name, for its gauges: `inference/NAME:info` is
    ("inference", "NAME", "info"); a peer's main calls have method "" and a single-model
    inference peer model ""."""
    peer, _, method = breaker.partition(":")
    service, _, model = peer.partition("/")
    return service, model, method


def inference_peer(model: str) -> str:
    """The peer (channel, breaker) of a model's inference service: `inference` for the one model
    of a deployment that names none, `inference/NAME` for each of several."""
    return f"inference/{model}" if model else "inference"


class Peers:
    """Stubs to the four downstreams, each behind its own circuit breaker; every call gets the
    smaller of the request's remaining deadline and its hop's budget. Inference is one peer per
    model (`models`: name -> target; by default the one unnamed model at targets["inference"]),
    each with its own channel and breaker.

    While a breaker is open, the peer's gRPC health service is checked every `probe_seconds`
    (each check with that timeout); the first SERVING answer half-opens the breaker at once, so a
    service back from a freeze or a restart is tried again within a probe interval instead of the
    breaker's whole wait (`CircuitBreaker.probe_passed`); no answer (or NOT_SERVING) keeps it
    open and starts its wait again (`probe_failed`). A peer without a health service
    (UNIMPLEMENTED) is left to the breaker's timer."""

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
        # A model with several replicas (`a:1|b:2`, or dns:///name:port) is routed over
        # them (services/gateway/routing.py); one with a single target keeps its one channel.
        self.routers = {
            model: ReplicaRouter(model, target, max_message_bytes, access, routing, loads, multiplex=multiplex)
            for model, target in models.items()
            if routed(target)
        }
        all_targets = {name: targets[name] for name in PEERS if name != "inference"}
        all_targets.update(
            {inference_peer(model): target for model, target in models.items() if model not in self.routers}
        )
        self.channels = {name: peer_channel(target, max_message_bytes, access) for name, target in all_targets.items()}
        breaker_names = [*all_targets, *(inference_peer(model) for model in self.routers)]
        breaker_names += [method_breaker(inference_peer(model), INFO) for model in models]
        breaker_names += [method_breaker("retrieval", m) for m in (INGEST, SEARCH, EMBED)]
        self.breakers = {
            name: CircuitBreaker(
                name,
                breaker_config,
                is_failure=counts_as_failure,
                on_transition=[*([on_transition(name)] if on_transition else []), self._prober(name)],
            )
            for name in breaker_names
        }
        self.health = {name: health_pb2_grpc.HealthStub(channel) for name, channel in self.channels.items()}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.channels["tokenizer"])
        self.inferences = {
            model: inference_pb2_grpc.InferenceStub(self.channels[inference_peer(model)])
            for model in models
            if model not in self.routers
        }
        # Each model's generations share one GenerateMany stream (services/gateway/multiplex.py).
        self.generators = {model: GenerationMux(stub, multiplex) for model, stub in self.inferences.items()}
        self.cache = cache_pb2_grpc.CacheStub(self.channels["cache"])
        self.retrieval = retrieval_pb2_grpc.RetrievalStub(self.channels["retrieval"])
        self.lookups = LookupCoalescer(self._cache_lookup, self._cache_lookup_batch)

    async def start(self) -> None:
        """Starts the replica routers' health checks, load watches and DNS refreshes."""
        for router in self.routers.values():
            await router.start()

    async def close(self) -> None:
        await tasks.stop_all(list(self._probes.values()))
        for router in self.routers.values():
            await router.close()
        for generator in self.generators.values():
            await generator.close()
        for channel in self.channels.values():
            await channel.close()

    def _prober(self, name: str) -> TransitionListener:
        def on_transition(old: State, new: State, reason: str) -> None:
            if new is not State.OPEN or not self.probe_seconds or name in self._probes:
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a transition outside the loop (tests): nothing to probe with
                return
            task = loop.create_task(self._probe(name))
            self._probes[name] = task
            task.add_done_callback(lambda _: self._probes.pop(name, None))

        return on_transition

    async def _probe(self, name: str) -> None:
        """Health-checks the peer while its breaker is open; a SERVING answer half-opens it."""
        breaker = self.breakers[name]
        request = health_pb2.HealthCheckRequest(service="")
        while breaker.state is State.OPEN:
            started = time.monotonic()
            try:
                reply = await self._health_of(channel_of(name)).Check(request, timeout=self.probe_seconds)
            except PeerCallError:
                breaker.probe_failed()  # a routed model with no replica known
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    breaker.probe_failed()  # no answer: no trials until it answers (or the wait ends)
            else:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    if breaker.probe_passed():
                        return
                else:
                    breaker.probe_failed()
            await asyncio.sleep(max(0.0, self.probe_seconds - (time.monotonic() - started)))

    def _health_of(self, peer: str) -> health_pb2_grpc.HealthStub:
        found = self.health.get(peer)
        if found is not None:
            return found
        model = next(m for m in self.routers if inference_peer(m) == peer)
        return self.routers[model].health_stub()

    def _inference(self, model: str) -> inference_pb2_grpc.InferenceStub:
        router = self.routers.get(model)
        return router.info_stub() if router is not None else self.inferences[model]

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
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            messages=messages, add_generation_prompt=True, tokenize=True, model=model, tools=tools
        )
        return await _unary(
            self.breakers["tokenizer"],
            lambda timeout: self.tokenizer.ApplyChatTemplate(request, timeout=timeout),
            deadline,
            self.budgets.tokenizer,
        )

    async def encode(self, text: str, deadline: Deadline, model: str = "") -> tokenizer_pb2.EncodeResponse:
        """A raw prompt's token ids, with the special tokens the model's tokenizer adds to a
        text (its BOS, if it has one). `model`: whose tokenizer ("" = the default)."""
        request = tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=True, model=model)
        return await _unary(
            self.breakers["tokenizer"],
            lambda timeout: self.tokenizer.Encode(request, timeout=timeout),
            deadline,
            self.budgets.tokenizer,
        )

    async def get_chat_template(self, deadline: Deadline, model: str = "") -> tokenizer_pb2.GetChatTemplateResponse:
        """The model's chat template itself (`model`: whose tokenizer, "" = the default)."""
        request = tokenizer_pb2.GetChatTemplateRequest(model=model)
        return await _unary(
            self.breakers["tokenizer"],
            lambda timeout: self.tokenizer.GetChatTemplate(request, timeout=timeout),
            deadline,
            self.budgets.tokenizer,
        )

    async def model_info(self, deadline: Deadline, model: str = "") -> inference_pb2.ModelInfo:
        request = inference_pb2.GetModelInfoRequest()
        stub = self._inference(model)
        return await _unary(
            self.breakers[method_breaker(inference_peer(model), INFO)],
            lambda timeout: stub.GetModelInfo(request, timeout=timeout),
            deadline,
            self.budgets.collection_info,
        )

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
        router = self.routers.get(model)
        if router is not None:  # over the model's replicas, one retry before the first token
            return router.generate(request, deadline, self.breakers[inference_peer(model)])
        generator = self.generators[model]
        return _stream(
            self.breakers[inference_peer(model)], lambda timeout: generator.generate(request, timeout), deadline
        )

    async def watch_load(self, model: str = "") -> AsyncIterator[inference_pb2.LoadReport]:
        """The model's inference load reports, for as long as the stream lasts: no
        deadline and no breaker (a long-lived stream that says nothing of a request's health);
        a failure is a PeerCallError (UNIMPLEMENTED: the backend reports no load)."""
        call = self.inferences[model].WatchLoad(inference_pb2.WatchLoadRequest())
        try:
            async for report in call:
                yield report
        except grpc.aio.AioRpcError as err:
            raise PeerCallError(from_rpc_error(inference_peer(model), err)) from err
        finally:
            call.cancel()

    async def cache_lookup(
        self, request: cache_pb2.CacheLookupRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupResponse:
        return await self.lookups.lookup(request, deadline)

    async def _cache_lookup(
        self, request: cache_pb2.CacheLookupRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupResponse:
        return await _unary(
            self.breakers["cache"],
            lambda timeout: self.cache.Lookup(request, timeout=timeout),
            deadline,
            self.budgets.cache_lookup,
        )

    async def _cache_lookup_batch(
        self, request: cache_pb2.CacheLookupBatchRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupBatchResponse:
        return await _unary(
            self.breakers["cache"],
            lambda timeout: self.cache.LookupBatch(request, timeout=timeout),
            deadline,
            self.budgets.cache_lookup,
        )

    async def cache_store(
        self, request: cache_pb2.CacheStoreRequest, deadline: Deadline
    ) -> cache_pb2.CacheStoreResponse:
        return await _unary(
            self.breakers["cache"],
            lambda timeout: self.cache.Store(request, timeout=timeout),
            deadline,
            self.budgets.cache_store,
        )

    async def cache_invalidate(
        self, request: cache_pb2.InvalidateRequest, deadline: Deadline
    ) -> cache_pb2.InvalidateResponse:
        """An admin purge: the caller's whole deadline (not an optional hop)."""
        return await _unary(
            self.breakers["cache"], lambda timeout: self.cache.Invalidate(request, timeout=timeout), deadline
        )

    async def collection_info(self, collection: str, tenant: str, deadline: Deadline) -> retrieval_pb2.CollectionInfo:
        request = retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=tenant)
        return await _unary(
            self.breakers["retrieval"],
            lambda timeout: self.retrieval.GetCollectionInfo(request, timeout=timeout),
            deadline,
            self.budgets.collection_info,
        )

    async def search(
        self, request: retrieval_pb2.RetrievalSearchRequest, deadline: Deadline, optional: bool = True
    ) -> retrieval_pb2.RetrievalSearchResponse:
        """`optional`: context for a generation (the search budget applies); else the caller's own
        search (its whole deadline)."""
        return await _unary(
            self.breakers["retrieval" if optional else method_breaker("retrieval", SEARCH)],
            lambda timeout: self.retrieval.Search(request, timeout=timeout),
            deadline,
            self.budgets.search if optional else None,
        )

    async def embed(
        self, request: retrieval_pb2.RetrievalEmbedRequest, deadline: Deadline, budget: float | None = None
    ) -> retrieval_pb2.RetrievalEmbedResponse:
        """A caller's embeddings (its own breaker, so a burst of them never opens the RAG hop's);
        `budget`: a bound below the caller's deadline (None: the whole deadline)."""
        return await _unary(
            self.breakers[method_breaker("retrieval", EMBED)],
            lambda timeout: self.retrieval.Embed(request, timeout=timeout),
            deadline,
            budget,
        )

    def upsert(
        self, request: retrieval_pb2.UpsertRequest, deadline: Deadline
    ) -> AsyncIterator[retrieval_pb2.UpsertProgress]:
        return _stream(
            self.breakers[method_breaker("retrieval", INGEST)],
            lambda timeout: self.retrieval.Upsert(request, timeout=timeout),
            deadline,
        )
