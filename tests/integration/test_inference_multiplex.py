"""Generations over Inference.GenerateMany, the gateway's GenerationMux against the real
inference service (tiny model, in-process on port 0): the same answers as Generate calls, fewer
messages than tokens, and each generation's cancellation, deadline, status and drain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from llmesh.errors import from_rpc_error
from llmesh.server import ServiceHost
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.gateway.multiplex import GenerationMux
from services.inference.engine import Engine
from services.inference.engine.front import RequestStream
from services.inference.servicer import InferenceApp

MAX_BATCH = 8


def tiny_env(models_dir: Path) -> dict[str, str]:
    return {
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DEVICE": "cpu",
        "LLMESH_MAX_PROMPT_TOKENS": "64",
        "LLMESH_MAX_NEW_TOKENS": "256",
        "LLMESH_MAX_BATCH_SIZE": str(MAX_BATCH),
        "LLMESH_ADMIN_TOKEN": "",
    }


@pytest.fixture(scope="module")
async def host(tiny_model: Path, models_dir: Path) -> AsyncIterator[ServiceHost]:
    async with hosted("inference", InferenceApp, env=tiny_env(models_dir)) as h:
        yield h


@pytest.fixture(scope="module")
async def channel(host: ServiceHost) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as ch:
        yield ch


@pytest.fixture
async def mux(channel: grpc.aio.Channel) -> AsyncIterator[GenerationMux]:
    made = GenerationMux(inference_pb2_grpc.InferenceStub(channel))
    yield made
    await made.close()


def engine_of(host: ServiceHost) -> Engine:
    return host.app.manager.get().engine  # type: ignore[attr-defined,no-any-return]


def request(text: str, **sampling: object) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(text=text, sampling=common_pb2.SamplingParams(**sampling))


async def collect(call: AsyncIterator[inference_pb2.InferenceResponse]) -> list[inference_pb2.InferenceResponse]:
    return [m async for m in call]


def batch_counts() -> tuple[float, float]:
    """(messages, updates) GenerateMany has sent in this process so far."""
    sample = REGISTRY.get_sample_value
    return (
        sample("llmesh_inference_multiplex_batch_updates_count") or 0.0,
        sample("llmesh_inference_multiplex_batch_updates_sum") or 0.0,
    )


async def test_many_generations_answer_as_generate_calls_do_in_fewer_messages(
    mux: GenerationMux, channel: grpc.aio.Channel
) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    asks = [request(f"Question number {i}", max_new_tokens=24, ignore_eos=True) for i in range(MAX_BATCH)]
    alone = [[m async for m in stub.Generate(r, timeout=30)] for r in asks]
    messages, updates = batch_counts()
    together = await asyncio.gather(*(collect(mux.generate(r, 30)) for r in asks))
    for one, other in zip(alone, together, strict=True):
        assert [list(m.token_ids) for m in one] == [list(m.token_ids) for m in other]
        assert "".join(m.text for m in one) == "".join(m.text for m in other)
        assert other[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert other[-1].usage.output_tokens == 24
    sent, carried = batch_counts()
    assert carried - updates == sum(len(r) for r in together)  # every update went out, once
    # Eight generations decoding in one batch: their tokens of a step travel together.
    assert (carried - updates) / (sent - messages) > 3


@pytest.fixture
def engine_cancels(monkeypatch: pytest.MonkeyPatch) -> asyncio.Queue[None]:
    """One item each time a request's engine stream is cancelled (its row freed within a step)."""
    cancels: asyncio.Queue[None] = asyncio.Queue()
    original = RequestStream.cancel

    def cancel(self: RequestStream) -> None:
        if not getattr(self, "_done", True):
            cancels.put_nowait(None)
        original(self)

    monkeypatch.setattr(RequestStream, "cancel", cancel)
    return cancels


async def test_a_cancelled_generation_frees_its_row(
    mux: GenerationMux, host: ServiceHost, engine_cancels: asyncio.Queue[None]
) -> None:
    call = mux.generate(request("Cancel me", max_new_tokens=256, ignore_eos=True), 30)
    first = await anext(call)
    assert first.token_ids
    assert engine_of(host).running_count == 1
    assert call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await anext(call)
    await asyncio.wait_for(engine_cancels.get(), 5)  # the replica told its engine
    assert mux.generations == 0


async def test_a_generation_past_its_deadline_ends_deadline_exceeded(
    mux: GenerationMux, engine_cancels: asyncio.Queue[None]
) -> None:
    call = mux.generate(request("Too slow", max_new_tokens=256, ignore_eos=True), 0.05)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(engine_cancels.get(), 5)


async def test_bad_input_is_the_status_a_generate_call_ends_with(mux: GenerationMux) -> None:
    call = mux.generate(request("Hello", max_new_tokens=100_000), 30)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error("inference", info.value)
    assert any(field == "sampling.max_new_tokens" for field, _ in error.violations())  # type: ignore[attr-defined]


class GenerateOnly(inference_pb2_grpc.InferenceServicer):
    """An inference service from before GenerateMany."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        yield inference_pb2.InferenceResponse(token_ids=[1], text="old")
        yield inference_pb2.InferenceResponse(finish_reason=common_pb2.FINISH_REASON_STOP)


async def test_a_replica_without_generate_many_is_asked_with_generate_calls() -> None:
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(GenerateOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            mux = GenerationMux(inference_pb2_grpc.InferenceStub(ch))
            # Both wait for the stream to open; the replica's UNIMPLEMENTED turns them into Generate calls.
            answers = await asyncio.gather(*(collect(mux.generate(request("hi"), 5)) for _ in range(2)))
            assert [[m.text for m in answer] for answer in answers] == [["old", ""], ["old", ""]]
            assert not mux.supported
            assert [m.text async for m in mux.generate(request("hi"), 5)] == ["old", ""]
            await mux.close()
    finally:
        await server.stop(0)


async def test_a_replica_that_goes_away_fails_its_generations_unavailable(models_dir: Path, tiny_model: Path) -> None:
    async with hosted("inference", InferenceApp, env=tiny_env(models_dir)) as h:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            mux = GenerationMux(inference_pb2_grpc.InferenceStub(ch))
            calls = [mux.generate(request(f"Long {i}", max_new_tokens=256, ignore_eos=True), 30) for i in range(3)]
            for call in calls:
                await anext(call)
            await h.server.stop(0)  # the process is gone: no drain
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
                assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            await mux.close()


async def test_a_draining_replica_finishes_its_generations_and_ends_the_stream(
    models_dir: Path, tiny_model: Path
) -> None:
    async with hosted("inference", InferenceApp, env=tiny_env(models_dir)) as h:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            mux = GenerationMux(inference_pb2_grpc.InferenceStub(ch))
            call = mux.generate(request("Finish me", max_new_tokens=48, ignore_eos=True), 30)
            await anext(call)
            began = time.monotonic()
            stopping = asyncio.ensure_future(h.stop(grace=30))
            rest = [m async for m in call]  # the generation runs to its end
            assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            await stopping
            # The stream ended with its last generation: the drain did not wait out its grace.
            assert time.monotonic() - began < 15
            await mux.close()
