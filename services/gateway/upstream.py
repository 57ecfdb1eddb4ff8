"""One owner per downstream, modelled on Envoy's cluster manager: an `Upstream` owns its
channel, its circuit breakers (the main calls' and one per method where calls differ), the health
probe that runs while a breaker is open, and the hop budgets of its calls. The request path asks
an upstream for a call, or for its state, and never keeps its own view of an outage.

`CacheUpstream` also owns how the cache looks to lookups (when it last answered one in full, and
whether it failed lately: the "suspect" window) and which requests it answered lately
(`RecentHits`); `RetrievalUpstream` owns the retrieval breakers (RAG search, a caller's own
search, ingest, embed); `TokenizerUpstream` the tokenizer's; `InferenceUpstream` one model's
inference: its replicas, their health checks and outlier ejection, and its load as admission
sees it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh import tasks
from llmesh.channels import PeerAccess, peer_channel
from llmesh.errors import LlmeshError, Unavailable, from_rpc_error
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
from services.gateway.admission.load import LoadBook, LoadWatcher
from services.gateway.breaker import BreakerConfig, CircuitBreaker, Permit, State, TransitionListener
from services.gateway.deadline import CallerDeadline, Deadline
from services.gateway.hop_errors import BREAKER_FAILURE_CODES, PeerCallError
from services.gateway.lookups import LookupCoalescer
from services.gateway.multiplex import GenerationMux
from services.gateway.recent_hits import RecentHits
from services.gateway.replicas import RoutingConfig
from services.gateway.routing import ReplicaRouter, routed
from services.gateway.versions import CollectionVersions

T = TypeVar("T")

# ...checking every this long that the cache answered something within the last this long.
CACHE_ALIVE_S = 0.01
# After the cache failed or answered degraded, requests decide admission before looking it up
# for this long.
CACHE_SUSPECT_S = 1.0

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


async def call_unary(
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
        raise judge(permit, breaker.name, err, caller_bound, deadline) from err
    except BaseException:
        permit.release()
        raise
    permit.success()
    return result


def judge(permit: Permit, name: str, err: grpc.aio.AioRpcError, caller_bound: bool, deadline: Deadline) -> LlmeshError:
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


async def call_stream(
    breaker: CircuitBreaker, start: Callable[[float], Any], deadline: Deadline, patient: bool = False
) -> AsyncIterator[Any]:
    """A server stream with the caller's deadline. The breaker judges the hop by its time to first
    message and the longest stall between messages, not by the stream's length: a wait past
    `slow_call_duration` is reported slow at once (while the call goes on), so a frozen service is
    cut off after the breaker's minimum calls; a half-open trial is decided by its first message.

    `patient`: a call that is meant to wait (batch work, queued behind interactive requests and
    preempted by them) is judged by its errors alone: its waits say nothing of the service's health,
    and counting them would open the breaker on the interactive traffic the waiting protects."""
    remaining = deadline.check(breaker.name)
    permit = breaker.acquire()
    slow_after = math.inf if patient else breaker.config.slow_call_duration
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

    timer = None if patient else loop.call_at(last + slow_after, watch)
    try:
        async for message in call:
            now = loop.time()
            if not patient:
                worst = max(worst, now - last)
                if timer is None:
                    timer = loop.call_at(now + slow_after, watch)
            last = now
            if permit.trial:
                permit.success(worst)
            yield message
        permit.success(worst)
    except grpc.aio.AioRpcError as err:
        raise judge(permit, breaker.name, err, True, deadline) from err
    finally:
        if timer is not None:
            timer.cancel()
        permit.release()  # no verdict yet (cancelled, or our caller went away): none is given
        # Our caller went away (or we failed): cancel downstream now, freeing its resources.
        call.cancel()


@dataclass(frozen=True)
class Guard:
    """How every upstream guards its calls: its breakers' settings, who hears their
    transitions (a listener per breaker name: logs, gauges), and how often an open breaker's
    downstream is probed (0: never)."""

    breaker_config: BreakerConfig | None = None
    on_transition: Callable[[str], TransitionListener] | None = None
    probe_seconds: float = 0.25


class Upstream:
    """One downstream: its channel (None where the upstream spreads its calls over replicas of
    its own), its breakers (`name` for the main calls, `name:method` for each of `methods`), and
    the health probe of each breaker while it is open.

    While a breaker is open, the downstream's gRPC health service is checked every
    `probe_seconds` (each check with that timeout); the first SERVING answer half-opens the
    breaker at once, so a service back from a freeze or a restart is tried again within a probe
    interval instead of the breaker's whole wait (`CircuitBreaker.probe_passed`); no answer (or
    NOT_SERVING) keeps it open and starts its wait again (`probe_failed`). A downstream without a
    health service (UNIMPLEMENTED) is left to the breaker's timer."""

    def __init__(
        self,
        name: str,
        channel: grpc.aio.Channel | None,
        methods: Sequence[str] = (),
        guard: Guard | None = None,
    ) -> None:
        guard = guard or Guard()
        self.name = name
        self.channel = channel
        self.probe_seconds = guard.probe_seconds
        self.health = health_pb2_grpc.HealthStub(channel) if channel is not None else None
        names = [name, *(method_breaker(name, m) for m in methods)]
        self.breakers = {
            breaker: CircuitBreaker(
                breaker,
                guard.breaker_config,
                is_failure=counts_as_failure,
                on_transition=[
                    *([guard.on_transition(breaker)] if guard.on_transition else []),
                    self._prober(breaker),
                ],
            )
            for breaker in names
        }
        self._probes: dict[str, asyncio.Task[None]] = {}

    def breaker(self, method: str = "") -> CircuitBreaker:
        """The breaker of the main calls, or of `method`'s."""
        return self.breakers[method_breaker(self.name, method) if method else self.name]

    def state(self, method: str = "") -> State:
        return self.breaker(method).state

    def unary(
        self, call: Callable[[float], Awaitable[T]], deadline: Deadline, budget: float | None = None, method: str = ""
    ) -> Awaitable[T]:
        """One unary call through the breaker (see `call_unary`); `budget`: the hop's (None: the
        caller's whole deadline)."""
        return call_unary(self.breaker(method), call, deadline, budget)

    def stream(
        self, start: Callable[[float], Any], deadline: Deadline, method: str = "", patient: bool = False
    ) -> AsyncIterator[Any]:
        """A server stream through the breaker (see `call_stream`)."""
        return call_stream(self.breaker(method), start, deadline, patient)

    async def serving(self) -> bool | None:
        """The probe's question: does the downstream answer its health check now? True (SERVING),
        False (no answer, or NOT_SERVING), None (no verdict: it serves no health service)."""
        if self.health is None:
            return False
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.probe_seconds)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False  # no answer: no trials until it answers (or the wait ends)
            return None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def start(self) -> None:
        """Background work the upstream owns (replica upstreams: health, load, DNS)."""

    async def close(self) -> None:
        await tasks.stop_all(list(self._probes.values()))
        if self.channel is not None:
            await self.channel.close()

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
        """Health-checks the downstream while the breaker is open; a SERVING answer half-opens it."""
        breaker = self.breakers[name]
        while breaker.state is State.OPEN:
            started = time.monotonic()
            verdict = await self.serving()
            if verdict:
                if breaker.probe_passed():
                    return
            elif verdict is False:
                breaker.probe_failed()
            await asyncio.sleep(max(0.0, self.probe_seconds - (time.monotonic() - started)))


class TokenizerUpstream(Upstream):
    """The tokenizer: one breaker, the tokenizer hop's budget on every call."""

    def __init__(self, channel: grpc.aio.Channel, budget: float, guard: Guard | None = None) -> None:
        super().__init__("tokenizer", channel, guard=guard)
        self.budget = budget
        self.stub = tokenizer_pb2_grpc.TokenizerStub(channel)

    async def chat_template(
        self,
        messages: Sequence[common_pb2.ChatMessage],
        deadline: Deadline,
        model: str,
        tools: Sequence[common_pb2.Tool],
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            messages=messages, add_generation_prompt=True, tokenize=True, model=model, tools=tools
        )
        return await self.unary(
            lambda timeout: self.stub.ApplyChatTemplate(request, timeout=timeout), deadline, self.budget
        )

    async def encode(self, text: str, deadline: Deadline, model: str) -> tokenizer_pb2.EncodeResponse:
        request = tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=True, model=model)
        return await self.unary(lambda timeout: self.stub.Encode(request, timeout=timeout), deadline, self.budget)

    async def get_chat_template(self, deadline: Deadline, model: str) -> tokenizer_pb2.GetChatTemplateResponse:
        request = tokenizer_pb2.GetChatTemplateRequest(model=model)
        return await self.unary(
            lambda timeout: self.stub.GetChatTemplate(request, timeout=timeout), deadline, self.budget
        )


class CacheUpstream(Upstream):
    """The answer cache: its breaker, its lookups (coalesced into LookupBatch calls under load),
    and how it looks to lookups: when it last answered one in full (a patient request waits
    while it keeps answering), whether it failed, ran out of its budget or answered degraded
    lately (then requests decide admission before looking it up), and which requests it
    answered lately (`recent_hits`)."""

    def __init__(
        self, channel: grpc.aio.Channel, lookup_budget: float, store_budget: float, guard: Guard | None = None
    ) -> None:
        super().__init__("cache", channel, guard=guard)
        self.lookup_budget = lookup_budget
        self.store_budget = store_budget
        self.stub = cache_pb2_grpc.CacheStub(channel)
        self.lookups = LookupCoalescer(self._lookup_one, self._lookup_batch)
        self.recent_hits = RecentHits()
        self.slow_until = 0.0
        self.answered_at = 0.0

    # --- calls ----------------------------------------------------------------------------------
    async def lookup(self, request: cache_pb2.CacheLookupRequest, deadline: Deadline) -> cache_pb2.CacheLookupResponse:
        return await self.lookups.lookup(request, deadline)

    async def _lookup_one(
        self, request: cache_pb2.CacheLookupRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupResponse:
        return await self.unary(
            lambda timeout: self.stub.Lookup(request, timeout=timeout), deadline, self.lookup_budget
        )

    async def _lookup_batch(
        self, request: cache_pb2.CacheLookupBatchRequest, deadline: Deadline
    ) -> cache_pb2.CacheLookupBatchResponse:
        return await self.unary(
            lambda timeout: self.stub.LookupBatch(request, timeout=timeout), deadline, self.lookup_budget
        )

    async def store(self, request: cache_pb2.CacheStoreRequest, deadline: Deadline) -> cache_pb2.CacheStoreResponse:
        return await self.unary(lambda timeout: self.stub.Store(request, timeout=timeout), deadline, self.store_budget)

    async def invalidate(
        self, request: cache_pb2.InvalidateRequest, deadline: Deadline
    ) -> cache_pb2.InvalidateResponse:
        """An admin purge: the caller's whole deadline (not an optional hop)."""
        return await self.unary(lambda timeout: self.stub.Invalidate(request, timeout=timeout), deadline)

    # --- how the cache looks to lookups ---------------------------------------------------------
    def heard(self, lookup: asyncio.Future[Any]) -> None:
        """Notes when the cache last answered a lookup in full (not degraded): the liveness a
        patient request waits on. A done callback of each lookup."""
        if not lookup.cancelled() and lookup.exception() is None and not lookup.result().degraded:
            self.answered_at = time.monotonic()

    def failed(self) -> None:
        """The cache failed, ran out of its budget or answered degraded: suspect for CACHE_SUSPECT_S."""
        self.slow_until = time.monotonic() + CACHE_SUSPECT_S

    def suspect(self) -> bool:
        """The cache failed, ran out of budget or answered degraded in the last CACHE_SUSPECT_S,
        or its breaker is not closed."""
        return time.monotonic() < self.slow_until or self.state() is not State.CLOSED

    async def wait_while_answering(
        self, lookup: asyncio.Future[cache_pb2.CacheLookupResponse], until: float
    ) -> cache_pb2.CacheLookupResponse:
        """Waits for `lookup` in steps of CACHE_ALIVE_S, each only while the cache answered some
        other lookup in full within the last step (it is busy, not frozen: this answer is likely
        on its way; lookups go out in batches), until `until`; raises TimeoutError when it stops."""
        while True:
            now = time.monotonic()
            if now >= until or now - self.answered_at > CACHE_ALIVE_S:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(lookup), min(CACHE_ALIVE_S, until - now))
            except TimeoutError:
                continue


class RetrievalUpstream(Upstream):
    """Retrieval: the RAG hop's breaker (collection versions, the context search), and one each
    for a caller's own search, ingest and embed, so none of them opens the RAG hop's; and the
    collection versions it told (`versions`, refreshed off the hit path; `ttl`: trusted this
    long), so whether a request's grounding is confirmed is asked here (`version`)."""

    def __init__(
        self, channel: grpc.aio.Channel, budgets: HopBudgets, guard: Guard | None = None, version_ttl: float = 2.0
    ) -> None:
        super().__init__("retrieval", channel, (INGEST, SEARCH, EMBED), guard)
        self.info_budget = budgets.collection_info
        self.search_budget = budgets.search
        self.stub = retrieval_pb2_grpc.RetrievalStub(channel)
        self.versions = CollectionVersions(self.collection_info, version_ttl)

    def available(self) -> bool:
        """Whether the RAG hop's breaker lets calls through (not open)."""
        return self.state() is not State.OPEN

    async def version(
        self, collection: str, tenant: str, deadline: Deadline
    ) -> tuple[retrieval_pb2.CollectionInfo, bool]:
        """The collection as last known (asked in the request's path the first time: its errors
        are raised), and whether it is confirmed: not while its last refresh failed or the RAG
        hop's breaker is open (an answer grounded in it is then degraded)."""
        known = await self.versions.get(collection, tenant, deadline)
        return known.info, not known.unconfirmed and self.available()

    async def collection_info(self, collection: str, tenant: str, deadline: Deadline) -> retrieval_pb2.CollectionInfo:
        request = retrieval_pb2.CollectionInfoRequest(collection=collection, tenant=tenant)
        return await self.unary(
            lambda timeout: self.stub.GetCollectionInfo(request, timeout=timeout), deadline, self.info_budget
        )

    async def search(
        self, request: retrieval_pb2.RetrievalSearchRequest, deadline: Deadline, optional: bool
    ) -> retrieval_pb2.RetrievalSearchResponse:
        return await self.unary(
            lambda timeout: self.stub.Search(request, timeout=timeout),
            deadline,
            self.search_budget if optional else None,
            "" if optional else SEARCH,
        )

    async def embed(
        self, request: retrieval_pb2.RetrievalEmbedRequest, deadline: Deadline, budget: float | None
    ) -> retrieval_pb2.RetrievalEmbedResponse:
        return await self.unary(lambda timeout: self.stub.Embed(request, timeout=timeout), deadline, budget, EMBED)

    def upsert(
        self, request: retrieval_pb2.UpsertRequest, deadline: Deadline
    ) -> AsyncIterator[retrieval_pb2.UpsertProgress]:
        return self.stream(lambda timeout: self.stub.Upsert(request, timeout=timeout), deadline, INGEST)


class InferenceUpstream(Upstream):
    """One model's inference (`inference` for the unnamed model, `inference/NAME` for each of
    several): the one owner of everything the gateway knows of its health and load.

    It owns the model's breakers (its generations', and `:info` for model info, so a cheap call
    never spends the generations' half-open trials nor closes their breaker while they fail),
    the probe while one is open, and its replicas: one channel, or a `ReplicaRouter` (a target
    of several replicas, `a:1|b:2`, or `dns:///name:port`) with each replica's channel, health
    checks, outlier ejection, load watch and DNS refresh. A routed model's probe asks its own
    replica set (a replica that passes its health checks and is not ejected) instead of sending
    checks of its own. The model's load goes into admission's book (`loads`) from here only: a
    single replica's WatchLoad stream (`watcher`), or the router's reports of the replicas it
    counts (an ejected, departed or silent replica's room is taken out)."""

    def __init__(
        self,
        model: str,
        target: str,
        max_message_bytes: int,
        access: PeerAccess | None = None,
        guard: Guard | None = None,
        info_budget: float = HopBudgets.collection_info,
        routing: RoutingConfig | None = None,
        loads: LoadBook | None = None,
        multiplex: bool = True,
    ) -> None:
        self.model = model
        self.info_budget = info_budget
        self.router: ReplicaRouter | None = None
        channel: grpc.aio.Channel | None = None
        if routed(target):
            self.router = ReplicaRouter(model, target, max_message_bytes, access, routing, loads, multiplex=multiplex)
        else:
            channel = peer_channel(target, max_message_bytes, access)
        super().__init__(inference_peer(model), channel, (INFO,), guard)
        self.stub = inference_pb2_grpc.InferenceStub(channel) if channel is not None else None
        # The model's generations share one GenerateMany stream (services/gateway/multiplex.py).
        self.generator = GenerationMux(self.stub, multiplex) if self.stub is not None else None
        self.watcher = LoadWatcher(loads, model, self.watch_load) if loads is not None and self.router is None else None

    async def start(self) -> None:
        """The router's health checks, load watches and DNS refreshes; or the load watch."""
        if self.router is not None:
            await self.router.start()
        if self.watcher is not None:
            self.watcher.start()

    async def close(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self.router is not None:
            await self.router.close()
        if self.generator is not None:
            await self.generator.close()
        await super().close()

    async def serving(self) -> bool | None:
        if self.router is None:
            return await super().serving()
        # The replicas in service, else any (as a pick would); their own health checks' verdicts.
        replicas = self.router.set.healthy() or list(self.router.set.replicas.values())
        if not replicas:
            return False  # no replica known
        if any(r.health_ok for r in replicas):
            return True
        if all(r.health_ok is None for r in replicas):
            return None  # no health service (or none answered yet): the breaker's timer decides
        return False

    def info_stub(self) -> inference_pb2_grpc.InferenceStub:
        if self.router is not None:
            return self.router.info_stub()
        assert self.stub is not None
        return self.stub

    async def model_info(self, deadline: Deadline) -> inference_pb2.ModelInfo:
        request = inference_pb2.GetModelInfoRequest()
        stub = self.info_stub()
        return await self.unary(
            lambda timeout: stub.GetModelInfo(request, timeout=timeout), deadline, self.info_budget, INFO
        )

    def generate(
        self, request: inference_pb2.InferenceRequest, deadline: Deadline
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        patient = request.priority > 0  # batch work waits behind interactive work by design
        if self.router is not None:  # over the model's replicas, one retry before the first token
            return self.router.generate(request, deadline, self.breaker(), patient)
        generator = self.generator
        assert generator is not None
        return self.stream(lambda timeout: generator.generate(request, timeout), deadline, patient=patient)

    async def watch_load(self) -> AsyncIterator[inference_pb2.LoadReport]:
        """The model's inference load reports, for as long as the stream lasts: no
        deadline and no breaker (a long-lived stream that says nothing of a request's health);
        a failure is a PeerCallError (UNIMPLEMENTED: the backend reports no load)."""
        if self.stub is None:
            raise PeerCallError(Unavailable(f"{self.name}: its replicas' load is watched by its router"))
        call = self.stub.WatchLoad(inference_pb2.WatchLoadRequest())
        try:
            async for report in call:
                yield report
        except grpc.aio.AioRpcError as err:
            raise PeerCallError(from_rpc_error(self.name, err)) from err
        finally:
            call.cancel()
