"""Breakers per peer and method, on a real gRPC server whose handlers fail or stall on
demand: a cheap call never spends nor closes the Generate breaker; Ingest never opens the breaker
the RAG search relies on; a stream that stalls and then fails counts as a failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from services.gateway.breaker import BreakerConfig, State
from services.gateway.peers import Deadline, PeerCallError, Peers


class Fake(inference_pb2_grpc.InferenceServicer, retrieval_pb2_grpc.RetrievalServicer):
    def __init__(self) -> None:
        self.stall = asyncio.Event()  # set: Generate sends a token, stalls until `resume`, then fails
        self.resume = asyncio.Event()

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return inference_pb2.ModelInfo(model_id="fake", sha256="0" * 64)

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        if self.stall.is_set():
            yield inference_pb2.InferenceResponse(token_ids=[1], text="a")
            await self.resume.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "fake failure")

    async def Upsert(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAVAILABLE, "fake ingest failure")
        yield retrieval_pb2.UpsertProgress()

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        return retrieval_pb2.RetrievalSearchResponse()


async def peers_on(fake: Fake, config: BreakerConfig) -> tuple[Peers, grpc.aio.Server]:
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    retrieval_pb2_grpc.add_RetrievalServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    targets = {name: target for name in ("tokenizer", "inference", "cache", "retrieval")}
    return Peers(targets, 4 * 1024 * 1024, config, probe_seconds=0), server


async def drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def test_cheap_calls_never_spend_nor_close_the_generate_breaker() -> None:
    config = BreakerConfig(consecutive_failures=2, wait_in_open=0.0, permitted_calls_in_half_open=2)
    peers, server = await peers_on(Fake(), config)
    try:
        generate = peers.breakers["inference"]
        for _ in range(2):
            with pytest.raises(PeerCallError):
                await drain(peers.generate([1, 2], common_pb2.SamplingParams(), "r", Deadline.after(5)))
        assert generate.state is State.HALF_OPEN  # opened, and its wait (0 s) is over
        for _ in range(5):  # model info answers: it says nothing of Generate
            await peers.model_info(Deadline.after(5))
        assert generate.state is State.HALF_OPEN
        assert generate.metrics().calls == 0 and generate.allow()  # its trials are all still there
    finally:
        await peers.close()
        await server.stop(None)


async def test_ingest_failures_never_open_the_rag_search_breaker() -> None:
    config = BreakerConfig(consecutive_failures=2, wait_in_open=30.0)
    peers, server = await peers_on(Fake(), config)
    try:
        for _ in range(2):
            with pytest.raises(PeerCallError):
                await drain(peers.upsert(retrieval_pb2.UpsertRequest(collection="c"), Deadline.after(5)))
        assert peers.breakers["retrieval:ingest"].state is State.OPEN
        assert peers.breakers["retrieval"].state is State.CLOSED
        await peers.search(retrieval_pb2.RetrievalSearchRequest(query="q", collection="c"), Deadline.after(5))
    finally:
        await peers.close()
        await server.stop(None)


async def test_a_stream_that_stalls_then_fails_counts_as_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake()
    fake.stall.set()
    config = BreakerConfig(slow_call_duration=0.2, consecutive_failures=0, minimum_calls=5)
    peers, server = await peers_on(fake, config)
    try:
        breaker = peers.breakers["inference"]
        reported = asyncio.Event()
        record = breaker._record

        def recorded(failed: bool, duration: float, generation: int) -> list[bool] | None:
            entry = record(failed, duration, generation)
            reported.set()
            return entry

        monkeypatch.setattr(breaker, "_record", recorded)
        stream = peers.generate([1, 2], common_pb2.SamplingParams(), "r", Deadline.after(10))
        first = await stream.__anext__()
        assert first.text == "a"
        # Wait until the stall has been reported (slow) to the breaker, then let the stream fail.
        await asyncio.wait_for(reported.wait(), 5)
        assert breaker.metrics().slow == 1 and breaker.metrics().failed == 0
        fake.resume.set()
        with pytest.raises(PeerCallError):
            await drain(stream)
        assert breaker.metrics().failed == 1 and breaker.metrics().calls == 1
    finally:
        await peers.close()
        await server.stop(None)


class Queued(Fake):
    """Answers after a wait longer than the breaker's slow-call duration, as a batch line queued
    behind interactive work does."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.4)  # simulated work: the engine's queue ahead of this request
        yield inference_pb2.InferenceResponse(token_ids=[1], text="a")


@pytest.mark.parametrize(("priority", "slow"), [(1, 0), (0, 1)])
async def test_batch_work_waiting_is_never_a_slow_call(priority: int, slow: int) -> None:
    """Batch lines wait behind interactive work (queued, preempted) by design: their waits must not
    open the breaker interactive traffic relies on. The same wait on an interactive call is slow."""
    config = BreakerConfig(slow_call_duration=0.2, consecutive_failures=0, minimum_calls=5)
    peers, server = await peers_on(Queued(), config)
    try:
        sampling = common_pb2.SamplingParams()
        await drain(peers.generate([1, 2], sampling, "r", Deadline.after(10), priority=priority))
        breaker = peers.breakers["inference"]
        assert breaker.metrics().calls == 1 and breaker.metrics().slow == slow
    finally:
        await peers.close()
        await server.stop(None)
