"""The gateway's MuxCall ends as a grpc.aio call does once the caller or its deadline ends it,
whatever the stream had delivered and the caller had not read yet."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.v1 import inference_pb2
from services.gateway.multiplex import MuxCall


class FakeStream:
    """What a MuxCall tells its stream: which generations it cancelled and forgot."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.forgotten: list[int] = []

    def cancel(self, generation: int) -> None:
        self.cancelled.append(generation)

    def forget(self, generation: int) -> None:
        self.forgotten.append(generation)


def token(text: str) -> inference_pb2.GenerationUpdate:
    return inference_pb2.GenerationUpdate(response=inference_pb2.InferenceResponse(text=text, token_ids=[1]))


async def test_a_cancelled_call_raises_on_its_next_read_with_tokens_still_unread() -> None:
    stream = FakeStream()
    call = MuxCall(stream, 7, inference_pb2.InferenceRequest(), None)  # type: ignore[arg-type]
    call.deliver(token("a"))
    assert (await anext(call)).text == "a"
    call.deliver(token("b"))  # arrived in the same step as the caller decided to stop
    assert call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await anext(call)
    assert stream.cancelled == [7] and stream.forgotten == [7]
    assert not call.cancel()  # once


async def test_a_call_past_its_deadline_raises_deadline_exceeded_with_tokens_still_unread() -> None:
    stream = FakeStream()
    call = MuxCall(stream, 3, inference_pb2.InferenceRequest(), 0.01)  # type: ignore[arg-type]
    call.deliver(token("a"))
    expired = asyncio.get_running_loop().create_future()
    # Due just after the call's own timer, so it runs after that timer fired.
    asyncio.get_running_loop().call_at((call.timeout_at or 0.0) + 0.001, expired.set_result, None)
    await expired
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stream.cancelled == [3]


async def test_an_error_from_the_replica_comes_after_what_it_sent_before() -> None:
    call = MuxCall(FakeStream(), 1, inference_pb2.InferenceRequest(), None)  # type: ignore[arg-type]
    call.deliver(token("a"))
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    call.deliver(inference_pb2.GenerationUpdate(status_code=unavailable, status_message="gone"))
    assert (await anext(call)).text == "a"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
