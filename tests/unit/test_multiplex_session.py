"""Inference.GenerateMany's server side (services/inference/multiplex.py) on fake generations:
what an engine step produces goes out as one message, and each generation keeps what a Generate
call has (cancellation, deadline, status, draining)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import status_pb2

from llmesh import errors
from llmesh.errors import unpack_details
from llmesh.v1 import inference_pb2
from services.inference import multiplex
from services.inference.multiplex import Multiplexer

END = object()


class FakeContext:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class Generations:
    """Fake generations, one per request text: each yields what the test puts in its queue (an
    exception is raised), ends at END; `asked[name]` is set each time the generation has taken
    its last item and asks for the next (so whatever it yielded is queued in the session)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[object]] = {}
        self.asked: dict[str, asyncio.Event] = {}
        self.closed: dict[str, asyncio.Event] = {}

    def of(self, name: str) -> asyncio.Queue[object]:
        if name not in self.queues:
            self.queues[name] = asyncio.Queue()
            self.asked[name] = asyncio.Event()
            self.closed[name] = asyncio.Event()
        return self.queues[name]

    async def generate(self, request: inference_pb2.InferenceRequest) -> AsyncIterator[inference_pb2.InferenceResponse]:
        name = request.text
        queue = self.of(name)
        try:
            while True:
                self.asked[name].set()
                item = await queue.get()
                self.asked[name].clear()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, inference_pb2.InferenceResponse)
                yield item
        finally:
            self.closed[name].set()

    async def step(self, *names: str) -> None:
        """One token for each of `names`, put in the same loop turn; returns once each is queued."""
        for name in names:
            self.asked[name].clear()
            self.of(name).put_nowait(token(name))
        for name in names:
            await self.asked[name].wait()


def token(text: str) -> inference_pb2.InferenceResponse:
    return inference_pb2.InferenceResponse(token_ids=[1], text=text)


def start(generation: int, name: str, timeout: float = 0.0) -> inference_pb2.GenerateManyRequest:
    return inference_pb2.GenerateManyRequest(
        start=inference_pb2.GenerationStart(
            id=generation, request=inference_pb2.InferenceRequest(text=name), timeout_seconds=timeout
        )
    )


def cancel(generation: int) -> inference_pb2.GenerateManyRequest:
    return inference_pb2.GenerateManyRequest(cancel=generation)


class Stream:
    """One GenerateMany stream served by a Multiplexer: `send` requests, `next` responses."""

    def __init__(self, mux: Multiplexer) -> None:
        self.requests: asyncio.Queue[inference_pb2.GenerateManyRequest | None] = asyncio.Queue()
        self.responses = mux.serve(self._requests(), FakeContext())  # type: ignore[arg-type]

    async def _requests(self) -> AsyncIterator[inference_pb2.GenerateManyRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    def send(self, *requests: inference_pb2.GenerateManyRequest | None) -> None:
        for request in requests:
            self.requests.put_nowait(request)

    async def next(self) -> inference_pb2.GenerateManyResponse:
        return await asyncio.wait_for(anext(self.responses), 5)

    async def open(self) -> None:
        assert not (await self.next()).updates  # the first message says the stream is open

    async def ended(self) -> bool:
        try:
            await asyncio.wait_for(anext(self.responses), 5)
        except StopAsyncIteration:
            return True
        return False


def texts(response: inference_pb2.GenerateManyResponse) -> list[tuple[int, str]]:
    return [(u.id, u.response.text) for u in response.updates]


@pytest.fixture
def gens() -> Generations:
    return Generations()


async def test_a_step_of_many_generations_goes_out_as_one_message(
    gens: Generations, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multiplex, "LINGER_MAX_S", 3600.0)  # only a complete step lets a message go
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(1, "a"), start(2, "b"), start(3, "c"))
    for name in "abc":
        gens.of(name)
    # A first token goes out at once: generations still waiting for theirs hold nothing up.
    await gens.asked["a"].wait()
    await gens.step("a")
    assert texts(await stream.next()) == [(1, "a")]
    await gens.step("a", "b", "c")
    assert sorted(texts(await stream.next())) == [(1, "a"), (2, "b"), (3, "c")]
    # All three decoding: one step is one message, held until the last of them has its token.
    await gens.step("a", "b")
    message = asyncio.ensure_future(stream.next())
    await gens.step("c")
    assert sorted(texts(await message)) == [(1, "a"), (2, "b"), (3, "c")]
    for name in "abc":
        gens.of(name).put_nowait(END)
    stream.send(None)
    while not await stream.ended():
        pass


async def test_a_step_that_never_completes_goes_out_after_the_linger(gens: Generations) -> None:
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(1, "a"), start(2, "b"))
    gens.of("a"), gens.of("b")
    await gens.step("a", "b")
    assert len((await stream.next()).updates) == 2
    await gens.step("a")  # b is stuck: a's token waits LINGER_MAX_S, not for b
    assert texts(await stream.next()) == [(1, "a")]


async def test_a_cancelled_generation_stops(gens: Generations) -> None:
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(7, "a"))
    gens.of("a")
    await gens.step("a")
    assert texts(await stream.next()) == [(7, "a")]
    stream.send(cancel(7))
    await asyncio.wait_for(gens.closed["a"].wait(), 5)  # the engine's row is freed
    stream.send(None)
    assert await stream.ended()  # nothing else runs: the half-closed stream ends


async def test_a_failed_generation_ends_with_the_status_generate_would_have(gens: Generations) -> None:
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(1, "bad"), start(2, "bug"))
    gens.of("bad").put_nowait(errors.InvalidArgument([("sampling.max_new_tokens", "must be at most 512")]))
    gens.of("bug").put_nowait(RuntimeError("a bug"))
    updates: dict[int, inference_pb2.GenerationUpdate] = {}
    while len(updates) < 2:
        updates.update({u.id: u for u in (await stream.next()).updates})
    bad, bug = updates[1], updates[2]
    assert bad.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    details = unpack_details(status_pb2.Status.FromString(bad.status_details))
    violation = details["bad_request"].field_violations[0]  # type: ignore[attr-defined]
    assert violation.field == "sampling.max_new_tokens"
    assert bug.status_code == grpc.StatusCode.INTERNAL.value[0] and bug.status_message == "internal error"


async def test_a_generation_past_its_deadline_ends_deadline_exceeded(gens: Generations) -> None:
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(1, "slow", timeout=0.05))  # it never produces a token
    update = (await stream.next()).updates[0]
    assert update.status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert gens.closed["slow"].is_set()


async def test_a_running_id_is_refused(gens: Generations) -> None:
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(1, "a"), start(1, "b"))
    update = (await stream.next()).updates[0]
    assert update.id == 1 and update.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already running" in update.status_message


async def test_draining_refuses_new_generations_and_ends_the_stream_after_the_running_ones(
    gens: Generations,
) -> None:
    mux = Multiplexer(gens.generate)
    stream = Stream(mux)
    await stream.open()
    stream.send(start(1, "a"))
    gens.of("a")
    await gens.step("a")
    assert texts(await stream.next()) == [(1, "a")]
    mux.drain()
    stream.send(start(2, "late"))
    refused = (await stream.next()).updates[0]
    assert refused.id == 2 and refused.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
    info = unpack_details(status_pb2.Status.FromString(refused.status_details))
    assert info["error_info"].reason == "DRAINING" and "retry_info" in info  # type: ignore[attr-defined]
    gens.of("a").put_nowait(inference_pb2.InferenceResponse(text="!", finish_reason=1))
    gens.of("a").put_nowait(END)
    assert texts(await stream.next()) == [(1, "!")]  # the running one finishes
    assert await stream.ended()  # and the stream ends with it: the drain is not held


async def test_a_stream_that_goes_away_stops_its_generations(gens: Generations) -> None:
    stream = Stream(Multiplexer(gens.generate))
    await stream.open()
    stream.send(start(1, "a"))
    gens.of("a")
    await gens.step("a")
    await stream.next()
    await stream.responses.aclose()  # grpc closes the handler when the caller is gone
    await asyncio.wait_for(gens.closed["a"].wait(), 5)
