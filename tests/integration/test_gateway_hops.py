"""The gateway against a fake peer set: in-process real gRPC servers (tokenizer, inference, cache,
retrieval in one server) whose handlers answer, hang, fail or stream slowly on demand. Deadlines,
hop budgets, refunds and hold release on every exit path, breakers that judge the hop, and the
cache store after the final message."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.errors import LlmeshError, status_details, unpack_details
from llmesh.testing import hosted, service_settings
from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.gateway import pipeline, upstream
from services.gateway.core import Delta, Final
from services.gateway.peers import Deadline
from services.gateway.servicer import GatewayApp

PROMPT_TOKENS = 10


@dataclass
class Behaviour:
    """What one fake method does: "ok", "hang" (until the test releases it or the call ends) or
    "fail" (with `code`)."""

    mode: str = "ok"
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    calls: int = 0
    called: asyncio.Event = field(default_factory=asyncio.Event)

    async def act(self, context: grpc.aio.ServicerContext, release: asyncio.Event) -> None:
        self.calls += 1
        self.called.set()
        if self.mode == "hang":
            await release.wait()
        elif self.mode == "fail":
            await context.abort(self.code, f"fake {self.mode}")


class FakePeers(
    health_pb2_grpc.HealthServicer,
    tokenizer_pb2_grpc.TokenizerServicer,
    inference_pb2_grpc.InferenceServicer,
    cache_pb2_grpc.CacheServicer,
    retrieval_pb2_grpc.RetrievalServicer,
):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.tokenizer = Behaviour()
        self.generate = Behaviour()
        self.lookup = Behaviour()
        self.store = Behaviour()
        self.info = Behaviour()
        self.search = Behaviour()
        self.health = Behaviour()  # the gRPC health check the gateway probes while a breaker is open
        self.tokens = 4  # tokens each Generate streams
        self.first_token_delay = 0.0
        self.token_interval = 0.0
        self.hit_text = ""  # a cache hit with this text when set
        self.hit_prompts: set[str] | None = None  # ...for these prompts only (None: any)
        self.hit_version: int | None = None  # ...under this collection version (None: `version`)
        self.slow_prompts: set[str] = set()  # lookups of these hang until released
        self.version = 1
        self.stored: list[cache_pb2.CacheStoreRequest] = []
        self.streams_done = 0
        self.priorities: list[int] = []  # InferenceRequest.priority of each Generate
        # Load reports the fake inference streams on WatchLoad (none unless a test puts some:
        # then admission falls back to its own guesses, as for a backend that reports nothing).
        self.load_reports: asyncio.Queue[inference_pb2.LoadReport] = asyncio.Queue()

    # health
    async def Check(self, request, context):  # type: ignore[no-untyped-def]
        await self.health.act(context, self.release)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    # tokenizer
    async def ApplyChatTemplate(self, request, context):  # type: ignore[no-untyped-def]
        await self.tokenizer.act(context, self.release)
        return tokenizer_pb2.ApplyChatTemplateResponse(ids=list(range(PROMPT_TOKENS)), token_count=PROMPT_TOKENS)

    # inference
    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return inference_pb2.ModelInfo(model_id="fake", sha256="0" * 64)

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.priorities.append(request.priority)
        await self.generate.act(context, self.release)
        await asyncio.sleep(self.first_token_delay)  # simulated work: the fake's time to a first token
        want = min(self.tokens, request.sampling.max_new_tokens)
        for i in range(want):
            if i:
                await asyncio.sleep(self.token_interval)  # simulated work: the fake's pace per token
            last = i == want - 1
            yield inference_pb2.InferenceResponse(
                token_ids=[100 + i],
                text=f"t{i} ",
                finish_reason=common_pb2.FINISH_REASON_STOP if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                usage=common_pb2.Usage(input_tokens=PROMPT_TOKENS, output_tokens=want) if last else None,
            )
        self.streams_done += 1

    async def WatchLoad(self, request, context):  # type: ignore[no-untyped-def]
        while True:
            yield await self.load_reports.get()

    # cache
    async def Lookup(self, request, context):  # type: ignore[no-untyped-def]
        if request.prompt in self.slow_prompts:
            self.lookup.called.set()
            await self.release.wait()
        else:
            await self.lookup.act(context, self.release)
        hits = self.hit_prompts is None or request.prompt in self.hit_prompts
        version = self.version if self.hit_version is None else self.hit_version
        if self.hit_text and hits and request.scope.collection_version == version:
            return cache_pb2.CacheLookupResponse(
                hit=True, tier=common_pb2.CACHE_TIER_EXACT, answer=cache_pb2.CachedAnswer(text=self.hit_text)
            )
        return cache_pb2.CacheLookupResponse(hit=False)

    async def LookupBatch(self, request, context):  # type: ignore[no-untyped-def]
        return cache_pb2.CacheLookupBatchResponse(results=[await self.Lookup(one, context) for one in request.requests])

    async def Store(self, request, context):  # type: ignore[no-untyped-def]
        await self.store.act(context, self.release)
        self.stored.append(request)
        return cache_pb2.CacheStoreResponse(stored=True)

    # retrieval
    async def GetCollectionInfo(self, request, context):  # type: ignore[no-untyped-def]
        await self.info.act(context, self.release)
        return retrieval_pb2.CollectionInfo(exists=True, points=3, version=self.version)

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        await self.search.act(context, self.release)
        return retrieval_pb2.RetrievalSearchResponse(
            results=[common_pb2.ScoredChunk(document_id="d1", text="context", score=0.9)]
        )


@contextlib.asynccontextmanager
async def fake_mesh(**env: str) -> AsyncIterator[tuple[FakePeers, GatewayApp, int]]:
    """The fake peers on one real gRPC server, and a gateway (hosted on port 0) pointed at them."""
    fake = FakePeers()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(fake, server)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(fake, server)
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    cache_pb2_grpc.add_CacheServicer_to_server(fake, server)
    retrieval_pb2_grpc.add_RetrievalServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    settings = {
        "LLMESH_TOKENIZER_TARGET": target,
        "LLMESH_INFERENCE_TARGET": target,
        "LLMESH_CACHE_TARGET": target,
        "LLMESH_RETRIEVAL_TARGET": target,
        **env,
    }
    try:
        async with hosted("gateway", GatewayApp, settings) as gw:
            app = gw.app
            assert isinstance(app, GatewayApp)
            yield fake, app, gw.port
            fake.release.set()
            await app.gateway.settle()
    finally:
        fake.release.set()
        await server.stop(grace=0.5)


def ask(max_new_tokens: int = 8, **kw: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt="What is the refund window?", sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens), **kw
    )


async def run(app: GatewayApp, request: gateway_pb2.GenerateRequest, seconds: float) -> Final:
    final = None
    async for event in app.gateway.generate(request, Deadline.after(seconds)):
        if isinstance(event, Final):
            final = event
    assert final is not None
    return final


@contextlib.asynccontextmanager
async def limit_filled(fake: FakePeers, app: GatewayApp) -> AsyncIterator[None]:
    """One request hangs in inference for the block, filling an in-flight limit of 640."""
    fake.generate.mode = "hang"
    busy = asyncio.create_task(run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 20))
    await fake.generate.called.wait()
    try:
        yield
    finally:
        busy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await busy


def no_weight_left(app: GatewayApp) -> None:
    window = app.window
    assert window.held() == 0  # type: ignore[union-attr]
    assert window.in_flight("fake@" + "0" * 16) == 0  # type: ignore[union-attr]


# --- deadlines -------------------------------------------------------------------------------------


def test_a_spent_deadline_has_no_time_left() -> None:
    assert Deadline(time.monotonic() - 1).remaining() == 0.0


async def test_a_spent_deadline_fails_fast_without_calling_anyone() -> None:
    async with fake_mesh() as (fake, app, _):
        with pytest.raises(LlmeshError) as spent:
            await run(app, ask(), 0.0)
        assert spent.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (fake.lookup.calls, fake.info.calls, fake.tokenizer.calls, fake.generate.calls) == (0, 0, 0, 0)
        no_weight_left(app)


# --- hop budgets -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hop", "degradation"),
    [
        ("lookup", "cache_unavailable"),
        ("info", "retrieval_unavailable"),
        ("search", "retrieval_unavailable"),
        ("tokenizer", "tokenizer_estimate"),
    ],
)
async def test_a_hung_optional_hop_degrades_within_its_budget(hop: str, degradation: str) -> None:
    budgets = {
        "LLMESH_HOP_CACHE_LOOKUP_SECONDS": "0.2",
        "LLMESH_HOP_COLLECTION_INFO_SECONDS": "0.2",
        "LLMESH_HOP_SEARCH_SECONDS": "0.2",
        "LLMESH_HOP_TOKENIZER_SECONDS": "0.2",
    }
    async with fake_mesh(**budgets) as (fake, app, _):
        getattr(fake, hop).mode = "hang"
        deadline = Deadline.after(3.0)
        final = None
        async for event in app.gateway.generate(ask(), deadline):
            if isinstance(event, Final):
                final = event
        assert final is not None and final.response.text
        assert degradation in final.response.degradations
        # Answered with most of the caller's deadline left: the hop had its own budget.
        assert deadline.remaining() > 1.5
        no_weight_left(app)


# --- breakers judge the hop ------------------------------------------------------------------------

BREAKER = {
    "LLMESH_BREAKER_WINDOW": "2",
    "LLMESH_BREAKER_MINIMUM_CALLS": "2",
    "LLMESH_BREAKER_WAIT_SECONDS": "30",
    "LLMESH_BREAKER_SLOW_CALL_SECONDS": "0.3",
    "LLMESH_BREAKER_PROBE_SECONDS": "0",  # the fake's health check always passes: no early half-open
}


async def test_callers_deadlines_do_not_open_the_inference_breaker() -> None:
    async with fake_mesh(**BREAKER) as (fake, app, _):
        fake.first_token_delay = 2.0  # slower than the callers are patient, not a stall past the breaker's verdict
        breaker = app.peers.breakers["inference"]
        for _ in range(3):
            with pytest.raises(LlmeshError) as impatient:
                await run(app, ask(use_cache=False, use_retrieval=False), 0.2)
            assert impatient.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert breaker.state.value == "closed"
        # No verdict: the impatient calls gave none, and the model-info lookup has its own breaker.
        assert (breaker.metrics().calls, breaker.metrics().failed) == (0, 0)
        assert app.peers.breakers["inference:info"].metrics().calls == 1
        no_weight_left(app)


async def test_a_long_stream_is_judged_by_its_pace_not_its_length() -> None:
    async with fake_mesh(**BREAKER) as (fake, app, _):
        fake.tokens, fake.token_interval = 8, 0.1  # 0.7 s in all, never more than 0.1 s between tokens
        breaker = app.peers.breakers["inference"]
        for _ in range(3):
            final = await run(app, ask(max_new_tokens=8, use_cache=False, use_retrieval=False), 10)
            assert final.response.usage.output_tokens == 8
        assert breaker.state.value == "closed"
        assert breaker.metrics().slow == 0


async def test_streams_that_stall_between_tokens_trip_the_breaker() -> None:
    async with fake_mesh(**BREAKER) as (fake, app, _):
        fake.tokens, fake.token_interval = 3, 0.6  # each gap longer than the 0.3 s slow-call threshold
        breaker = app.peers.breakers["inference"]
        for _ in range(2):
            await run(app, ask(max_new_tokens=3, use_cache=False, use_retrieval=False), 10)
        assert breaker.state.value == "open"
        with pytest.raises(LlmeshError) as cut_off:
            await run(app, ask(use_cache=False, use_retrieval=False), 10)
        assert cut_off.value.reason == "CIRCUIT_OPEN"


async def test_a_frozen_inference_is_cut_off_after_the_minimum_calls() -> None:
    async with fake_mesh(**BREAKER) as (fake, app, _):
        fake.generate.mode = "hang"
        breaker = app.peers.breakers["inference"]
        opened = asyncio.Event()
        breaker.on_transition.append(lambda old, new, reason: opened.set() if new.value == "open" else None)
        waiting = [asyncio.create_task(run(app, ask(use_cache=False, use_retrieval=False), 20)) for _ in range(2)]
        # Both calls are still waiting for their first token when the breaker opens.
        await asyncio.wait_for(opened.wait(), 5.0)
        assert not any(task.done() for task in waiting)
        with pytest.raises(LlmeshError) as cut_off:
            await run(app, ask(use_cache=False, use_retrieval=False), 20)
        assert cut_off.value.code == grpc.StatusCode.UNAVAILABLE and cut_off.value.reason == "CIRCUIT_OPEN"
        fake.release.set()
        for task in waiting:
            assert (await task).response.text  # the frozen service woke up: the calls finished
        no_weight_left(app)


async def test_a_half_open_trial_is_decided_by_its_first_token() -> None:
    env = {**BREAKER, "LLMESH_BREAKER_HALF_OPEN_CALLS": "1"}
    async with fake_mesh(**env) as (fake, app, _):
        breaker = app.peers.breakers["inference"]
        fake.generate.mode = "fail"
        for _ in range(2):
            with pytest.raises(LlmeshError):
                await run(app, ask(use_cache=False, use_retrieval=False), 5)
        assert breaker.state.value == "open"
        fake.generate.mode = "ok"
        fake.tokens, fake.token_interval = 8, 0.2
        later = breaker.clock() + 31.0  # past the breaker's wait in open
        breaker.clock = lambda: later
        assert breaker.state.value == "half_open"
        stream = app.gateway.generate(ask(max_new_tokens=8, use_cache=False, use_retrieval=False), Deadline.after(10))
        first = await anext(stream)
        assert isinstance(first, Delta)
        # The trial passed at its first token; the rest of the stream is still coming.
        assert breaker.state.value == "closed"
        rest = [event async for event in stream]
        assert isinstance(rest[-1], Final) and rest[-1].response.usage.output_tokens == 8


async def test_a_frozen_tokenizer_is_cut_off_after_a_few_timeouts_and_tried_again_once_it_answers() -> None:
    # Defaults for the window (10 calls before the rates count) and a long wait in open: the
    # breaker opens on five timeouts in a row, and a passing health probe half-opens it at once.
    env = {
        "LLMESH_HOP_TOKENIZER_SECONDS": "0.05",
        "LLMESH_BREAKER_WAIT_SECONDS": "60",
        "LLMESH_BREAKER_PROBE_SECONDS": "0.05",
    }
    async with fake_mesh(**env) as (fake, app, _):
        breaker = app.peers.breakers["tokenizer"]
        half_open = asyncio.Event()
        breaker.on_transition.append(lambda old, new, reason: half_open.set() if new.value == "half_open" else None)
        fake.tokenizer.mode = fake.health.mode = "hang"  # frozen: no answer, not even to health checks
        for _ in range(5):
            final = await run(app, ask(use_cache=False, use_retrieval=False), 5)
            assert "tokenizer_estimate" in final.response.degradations
        assert breaker.state.value == "open"
        calls = fake.tokenizer.calls
        final = await run(app, ask(use_cache=False, use_retrieval=False), 5)
        assert "tokenizer_estimate" in final.response.degradations and fake.tokenizer.calls == calls  # cut off
        await asyncio.wait_for(fake.health.called.wait(), 5.0)  # probed while open, and still frozen
        assert breaker.state.value == "open"
        fake.tokenizer.mode = fake.health.mode = "ok"  # SIGCONT
        fake.release.set()
        await asyncio.wait_for(half_open.wait(), 5.0)  # a probe interval, not the 60 s wait
        for _ in range(3):  # the half-open trials
            final = await run(app, ask(use_cache=False, use_retrieval=False), 5)
            assert "tokenizer_estimate" not in final.response.degradations
        assert breaker.state.value == "closed"
        no_weight_left(app)


# --- refunds and holds on every exit path -----------------------------------------------------------

MODEL = "fake@" + "0" * 16


async def test_a_request_that_stops_early_pays_only_what_it_generated() -> None:
    async with fake_mesh() as (fake, app, _):
        fake.tokens = 3
        final = await run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 10)
        assert final.response.usage.output_tokens == 3
        assert app.window.occupancy() == PROMPT_TOKENS * 3  # type: ignore[union-attr]
        no_weight_left(app)


async def test_the_batch_lane_reaches_the_engine_as_batch_priority() -> None:
    # The engine serves priority 0 first and preempts priority 1 rows for it: the gateway's batch
    # lane must arrive as 1, and every other request as 0.
    async with fake_mesh() as (fake, app, _):
        await run(app, ask(use_cache=False, use_retrieval=False, lane="batch"), 10)
        await run(app, ask(use_cache=False, use_retrieval=False), 10)
        assert fake.priorities == [1, 0]


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL]
)
async def test_a_request_refused_or_failed_downstream_is_refunded(code: grpc.StatusCode) -> None:
    async with fake_mesh() as (fake, app, _):
        fake.generate.mode, fake.generate.code = "fail", code
        with pytest.raises(LlmeshError) as failed:
            await run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 10)
        assert failed.value.code == code
        assert app.window.occupancy() == 0  # type: ignore[union-attr]
        no_weight_left(app)


async def test_a_request_stopped_by_an_open_breaker_or_the_callers_deadline_is_refunded() -> None:
    async with fake_mesh(**BREAKER) as (fake, app, _):
        fake.generate.mode = "hang"
        with pytest.raises(LlmeshError) as late:
            await run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 0.3)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert app.window.occupancy() == 0  # type: ignore[union-attr]
        no_weight_left(app)
        for _ in range(2):
            app.peers.breakers["inference"].record_failure(0.0)
        with pytest.raises(LlmeshError) as open_:
            await run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 5)
        assert open_.value.reason == "CIRCUIT_OPEN"
        assert app.window.occupancy() == 0  # type: ignore[union-attr]
        no_weight_left(app)


async def test_a_cancelled_request_releases_its_hold_and_reservation() -> None:
    async with fake_mesh() as (fake, app, _):
        fake.generate.mode = "hang"
        task = asyncio.create_task(run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 10))
        await fake.generate.called.wait()
        assert app.window.in_flight(MODEL) == PROMPT_TOKENS * 64  # type: ignore[union-attr]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert app.window.occupancy() == 0  # type: ignore[union-attr]
        no_weight_left(app)


async def test_a_request_that_would_be_shed_on_a_miss_does_not_wait_for_a_frozen_cache() -> None:
    env = {"LLMESH_HOP_CACHE_LOOKUP_SECONDS": "5", "LLMESH_ADMISSION_INITIAL_IN_FLIGHT": "640"}
    async with fake_mesh(**env) as (fake, app, _):
        async with limit_filled(fake, app):  # the in-flight limit is now full
            fake.lookup.mode = "hang"
            deadline = Deadline.after(10)
            with pytest.raises(LlmeshError) as shed:
                async for _ in app.gateway.generate(ask(max_new_tokens=64, use_retrieval=False), deadline):
                    pass
            assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert deadline.remaining() > 9  # not the cache's 5 s budget: it would be shed on a miss anyway
        no_weight_left(app)


async def test_a_frozen_cache_is_cut_off_though_every_request_gives_up_on_it_early() -> None:
    # Every request would be shed on a miss, so each waits 20 ms for the cache and goes on; the
    # lookups they started still run to their budget and the breaker hears the timeouts.
    env = {"LLMESH_HOP_CACHE_LOOKUP_SECONDS": "0.1", "LLMESH_ADMISSION_INITIAL_IN_FLIGHT": "640"}
    async with fake_mesh(**env) as (fake, app, _):
        breaker = app.peers.breakers["cache"]
        opened = asyncio.Event()
        breaker.on_transition.append(lambda old, new, reason: opened.set() if new.value == "open" else None)
        async with limit_filled(fake, app):  # the in-flight limit is now full
            fake.lookup.mode = "hang"
            for _ in range(8):
                if opened.is_set():
                    break
                with pytest.raises(LlmeshError) as shed:
                    await run(app, ask(max_new_tokens=64, use_retrieval=False), 10)
                assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(opened.wait(), 0.5)
            assert opened.is_set() and breaker.state.value == "open"
        no_weight_left(app)


async def test_a_request_waiting_for_the_cache_holds_its_room_and_is_not_shed_after_the_wait() -> None:
    # A fits when it starts and holds its predicted weight while the frozen cache keeps it
    # waiting; B, arriving meanwhile, is shed at once; A then misses and is admitted on its hold.
    env = {"LLMESH_HOP_CACHE_LOOKUP_SECONDS": "0.3", "LLMESH_ADMISSION_INITIAL_IN_FLIGHT": "640"}
    async with fake_mesh(**env) as (fake, app, _):
        fake.lookup.mode = "hang"
        waiting = asyncio.create_task(run(app, ask(max_new_tokens=64, use_retrieval=False), 10))
        await fake.lookup.called.wait()
        deadline = Deadline.after(10)
        with pytest.raises(LlmeshError) as shed:
            await run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 10)
        assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert deadline.remaining() > 9.9  # refused without waiting for anything
        final = await waiting
        assert final.response.text and "cache_unavailable" in final.response.degradations
        assert fake.generate.calls == 1
        no_weight_left(app)


def load_report(running: int, max_running: int, waiting: int, step_seconds: float) -> inference_pb2.LoadReport:
    return inference_pb2.LoadReport(
        model_id="fake",
        replica="fake-0",
        reported=True,
        running=running,
        max_running=max_running,
        waiting=waiting,
        kv_blocks_free=1000,
        kv_blocks_total=1000,
        block_tokens=16,
        waiting_prompt_tokens=waiting * PROMPT_TOKENS,
        step_seconds=step_seconds,
        prefill_tokens_per_second=10_000,
    )


async def test_a_cacheable_request_that_missed_is_judged_again_before_the_tokenizer() -> None:
    # Where the engine reports its load, a cacheable request holds nothing while its lookup
    # waits. This one fit when it asked; its lookup then took the whole budget while the
    # engine's queue grew far past the target. It is refused right after the lookup, before
    # the tokenizer's work (it used to be refused at admission, after it).
    async with fake_mesh(LLMESH_HOP_CACHE_LOOKUP_SECONDS="0.3") as (fake, app, _):
        watcher = app.load_watchers[0]
        fake.load_reports.put_nowait(load_report(running=0, max_running=4, waiting=0, step_seconds=0.01))
        await asyncio.wait_for(watcher.connected.wait(), 10)
        fake.lookup.mode = "hang"
        deadline = Deadline.after(10)
        waiting = asyncio.create_task(run(app, ask(max_new_tokens=8, use_retrieval=False), 10))
        await fake.lookup.called.wait()
        watcher.connected.clear()
        fake.load_reports.put_nowait(load_report(running=4, max_running=4, waiting=400, step_seconds=0.5))
        await asyncio.wait_for(watcher.connected.wait(), 10)  # the full engine's report is in
        with pytest.raises(LlmeshError) as shed:
            await waiting
        assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert shed.value.reason == "QUEUE_WAIT_TOO_LONG"
        assert deadline.remaining() > 9  # after the lookup's 0.3 s budget, not the deadline
        assert fake.tokenizer.calls == 0 and fake.generate.calls == 0
        no_weight_left(app)


async def test_under_overload_a_request_the_cache_answered_lately_waits_for_its_hit_and_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The limit is full. The cache is slow with a request it answered a moment ago but answers
    # others: that one keeps waiting past the short wait and is served from the cache (it costs
    # the model nothing); another cacheable request, unknown, misses and is shed at once.
    # Widened for a loaded machine: the unknown request's answer counts as the cache answering
    # for a whole second.
    monkeypatch.setattr(pipeline, "SHED_RISK_LOOKUP_S", 0.3)
    monkeypatch.setattr(pipeline, "KNOWN_HIT_WAIT_S", 4.0)
    monkeypatch.setattr(upstream, "CACHE_ALIVE_S", 1.0)  # read by CacheUpstream.wait_while_answering
    env = {"LLMESH_HOP_CACHE_LOOKUP_SECONDS": "5", "LLMESH_ADMISSION_INITIAL_IN_FLIGHT": "640"}
    async with fake_mesh(**env) as (fake, app, _):
        known_prompt = ask().prompt
        fake.hit_text, fake.hit_prompts = "Thirty days.", {known_prompt}
        first = await run(app, ask(max_new_tokens=64), 10)
        assert first.response.cache.hit
        async with limit_filled(fake, app):  # the in-flight limit is now full
            fake.slow_prompts.add(known_prompt)
            fake.lookup.called.clear()
            known = asyncio.create_task(run(app, ask(max_new_tokens=64), 10))
            await fake.lookup.called.wait()
            unknown = ask(max_new_tokens=64)
            unknown.prompt = "Do you ship abroad?"
            with pytest.raises(LlmeshError) as shed:
                await run(app, unknown, 10)
            assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            done, _ = await asyncio.wait({known}, timeout=0.6)  # past the short wait: still waiting
            assert not done
            fake.release.set()
            served = await known
            assert served.response.cache.hit and served.response.text == "Thirty days."
        no_weight_left(app)


async def test_under_overload_a_request_the_cache_answered_lately_gives_up_on_a_frozen_cache_early() -> None:
    env = {"LLMESH_HOP_CACHE_LOOKUP_SECONDS": "5", "LLMESH_ADMISSION_INITIAL_IN_FLIGHT": "640"}
    async with fake_mesh(**env) as (fake, app, _):
        fake.hit_text = "Thirty days."
        assert (await run(app, ask(max_new_tokens=64), 10)).response.cache.hit
        async with limit_filled(fake, app):  # the in-flight limit is now full
            fake.lookup.mode = "hang"  # frozen: it answers nobody
            deadline = Deadline.after(10)
            with pytest.raises(LlmeshError) as shed:
                async for _ in app.gateway.generate(ask(max_new_tokens=64), deadline):
                    pass
            assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert deadline.remaining() > 9  # the short wait, not the cache's 5 s budget
        no_weight_left(app)


async def test_lookups_queued_behind_a_frozen_cache_wait_no_longer_than_the_budget() -> None:
    # Two lookups go out at once; the rest queue for the next batch. A queued request's wait for
    # the cache (its queue time included) is one budget, not one for the queue and one for its batch.
    async with fake_mesh(LLMESH_HOP_CACHE_LOOKUP_SECONDS="0.3") as (fake, app, _):
        fake.lookup.mode = "hang"
        finals = await asyncio.gather(*(run(app, ask(use_retrieval=False), 10) for _ in range(6)))
        for final in finals:
            assert "cache_unavailable" in final.response.degradations
            assert final.timings["cache"] < 450  # ms; queued behind the first batch: about 600
        no_weight_left(app)


async def test_a_request_that_could_not_finish_in_time_is_shed_not_timed_out() -> None:
    async with fake_mesh() as (fake, app, _):
        capacity = app.window.capacity(MODEL)  # type: ignore[union-attr]
        capacity.throughput = 100.0  # measured: 100 weight per second
        with pytest.raises(LlmeshError) as shed:
            await run(app, ask(max_new_tokens=64, use_cache=False, use_retrieval=False), 3.0)  # 6.4 s of work
        assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and shed.value.reason == "DEADLINE_TOO_SHORT"
        assert fake.tokenizer.calls == 0 and fake.generate.calls == 0  # decided before the hops: a fast refusal
        final = await run(app, ask(max_new_tokens=16, use_cache=False, use_retrieval=False), 3.0)  # 1.6 s
        assert final.response.text
        no_weight_left(app)


# --- the cache store comes after the final message ----------------------------------------------------


async def test_the_answer_reaches_the_caller_while_the_cache_store_hangs() -> None:
    async with fake_mesh() as (fake, app, port):
        fake.store.mode = "hang"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            # The caller's deadline ends while the store is still hanging: the answer is not lost.
            reply = await gateway_pb2_grpc.GatewayStub(channel).Generate(ask(use_retrieval=False), timeout=1.5)
        assert reply.text and reply.finish_reason == common_pb2.FINISH_REASON_STOP
        await asyncio.wait_for(fake.store.called.wait(), 5.0)
        fake.release.set()
        await app.gateway.settle()
        assert [s.answer.text for s in fake.stored] == [reply.text]


# --- the collection version off the hit path ------------------------------------------------------------


async def test_cached_rag_answers_serve_while_retrieval_is_frozen() -> None:
    env = {"LLMESH_COLLECTION_VERSION_TTL_SECONDS": "0.05", "LLMESH_HOP_COLLECTION_INFO_SECONDS": "0.2"}
    async with fake_mesh(**env) as (fake, app, _):
        fake.hit_text = "30 days"
        first = await run(app, ask(), 5)
        assert first.response.cache.hit and not first.response.degradations
        assert fake.info.calls == 1
        for _ in range(5):
            await run(app, ask(), 5)
        assert fake.info.calls <= 2  # not once per request: learned, refreshed in the background
        fake.info.mode = "hang"
        fake.info.called.clear()
        refreshes = fake.info.calls
        # Wait (on the refresh itself) until a refresh has been tried against the frozen service.
        while fake.info.calls == refreshes:
            await run(app, ask(), 5)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fake.info.called.wait(), 0.1)
        known = app.gateway.versions.known[("default", "docs")]
        refreshing = known.refreshing
        if refreshing is not None:
            await refreshing
        served = await run(app, ask(), 5)
        assert served.response.cache.hit and served.response.text == "30 days"
        assert "retrieval_unavailable" in served.response.degradations


async def test_an_ingest_through_the_gateway_refreshes_the_version_at_once() -> None:
    async with fake_mesh(**{"LLMESH_COLLECTION_VERSION_TTL_SECONDS": "600"}) as (fake, app, _):
        await run(app, ask(), 5)
        assert fake.info.calls == 1
        app.gateway.versions.forget("docs", "default")  # what Ingest does once Upsert ends
        fake.version = 2
        await run(app, ask(), 5)
        assert fake.info.calls == 2
        assert app.gateway.versions.known[("default", "docs")].info.version == 2


def test_shed_replies_carry_retry_info_from_the_in_flight_limit() -> None:
    from services.gateway.admission import AdmissionConfig, WeightWindow

    window = WeightWindow(AdmissionConfig(budget=1e9, adaptive=True, initial_in_flight=1000))
    first = window.plan("t", 10, 50)
    assert first.ticket is not None
    with pytest.raises(LlmeshError) as shed:
        window.plan("t", 10, 100, allow_degrade=False)
    assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = unpack_details(status_details(shed.value.trailing_metadata()))
    assert info["error_info"].reason == "IN_FLIGHT_LIMIT"  # type: ignore[attr-defined]
    assert info["retry_info"].retry_delay.ToTimedelta().total_seconds() > 0  # type: ignore[attr-defined]
    first.ticket.finish()
    assert window.plan("t", 10, 100, allow_degrade=False).weight == 1000


def test_settings_parse() -> None:
    s = service_settings("gateway", {"LLMESH_HOP_TOKENIZER_SECONDS": "0.05"})
    assert s.hops.tokenizer_seconds == 0.05 and s.admission.adaptive is True


async def test_a_hit_without_the_lost_context_says_which_model_answered() -> None:
    # The search fails after the grounded lookup missed: the answer made earlier without context
    # serves (the second lookup), and like any hit it names the model that answered it.
    async with fake_mesh() as (fake, app, _):
        fake.hit_text, fake.hit_version = "30 days", 0
        fake.search.mode = "fail"
        served = await run(app, ask(), 5)
        assert served.response.cache.hit and served.response.text == "30 days"
        assert "retrieval_unavailable" in served.response.degradations
        assert fake.search.calls >= 1
        assert served.response.answered_by == "fake"
        fake.hit_version = None  # the grounded lookup hits: the same name
        grounded = await run(app, ask(), 5)
        assert grounded.response.cache.hit and grounded.response.answered_by == "fake"
        no_weight_left(app)
