"""The openai backend across replicas: a generation whose replica fails before its first
token in a way another replica may fix (refused, timed out, 5xx, 429/503, a stream that ends or
breaks with nothing in it) is tried once more on another replica, within a retry budget; after the
first token, for a request the server rejects, or for a cancelled one, never.

The replicas here are `httpx.MockTransport` handlers: they stand for the FAILING replica (a failure
on cue); what a real engine answers is tested on vLLM (tests/integration/test_openai_backend.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import DEFAULT_ON
from opentelemetry.trace import StatusCode

from llmesh import errors
from llmesh.spans import LeanTracerProvider
from services.inference import metrics, openai_backend
from services.inference.engine import FINISH_LENGTH, GenerationEvent
from services.inference.engine.decoding import SamplingParams
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def sse(*payloads: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)


def piece(text: str, finish: str | None = None) -> dict:
    return {"id": "c1", "model": "smollm2", "choices": [{"text": text, "finish_reason": finish}]}


USAGE = {"id": "c1", "model": "smollm2", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
ANSWER = sse(piece("Pa"), piece("ris", "length"), USAGE) + b"data: [DONE]\n\n"


def streaming(*reads: bytes | Exception) -> httpx.Response:
    """A 200 whose body is `reads`, one socket read each; an exception is raised where it stands."""

    async def body() -> AsyncIterator[bytes]:
        for read in reads:
            if isinstance(read, Exception):
                raise read
            yield read

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


async def answers(request: httpx.Request) -> httpx.Response:
    return streaming(ANSWER)


def status(code: int, message: str = "no") -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(code, json={"object": "error", "message": message, "code": code})

    return handle


def raising(make: Callable[[httpx.Request], Exception]) -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        raise make(request)

    return handle


def body_of(*reads: bytes | Exception) -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        return streaming(*reads)

    return handle


class Replicas:
    """Fake servers by host: each /completions goes to its host's handler; the hits are counted."""

    def __init__(self, **handlers: Handler) -> None:
        self.handlers = {host: handlers[name] for name, host in (("a", A), ("b", B), ("c", C)) if name in handlers}
        self.hits: Counter[str] = Counter()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.hits[request.url.host] += 1
        return await self.handlers[request.url.host](request)


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(models_dir, "smollm2")


class Spans:
    """The backend's spans, recorded by a provider of this test's own (not the process's)."""

    def __init__(self) -> None:
        self.provider = LeanTracerProvider(resource=Resource.create({"service.name": "unit"}), sampler=DEFAULT_ON)
        self.exporter = InMemorySpanExporter()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def ended(self, name: str) -> list[ReadableSpan]:
        self.provider.force_flush()
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spans]:
    recorded = Spans()
    monkeypatch.setattr(openai_backend, "tracer", recorded.provider.get_tracer("llmesh.inference"))
    yield recorded
    recorded.provider.shutdown()


async def make(tokenizer: LocalTokenizer, servers: Replicas) -> OpenAIBackend:
    """A backend on the servers' hosts (in that order), all healthy."""
    urls = tuple(f"http://{host}:8000/v1" for host in servers.handlers)
    backend = OpenAIBackend(BackendConfig(urls=urls, model="smollm2"), tokenizer)
    await backend.client.aclose()
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(servers.handle))
    for replica in backend.replicas:
        replica.listed = replica.healthy = True
    return backend


async def generate(backend: OpenAIBackend) -> list[GenerationEvent]:
    """One request, its turn started over: of the healthy replicas with the fewest in flight, it
    goes to the first."""
    backend._turn = itertools.count()
    return [event async for event in backend.submit([1, 2, 3], SamplingParams(max_new_tokens=2))]


def retries(reason: str) -> float:
    return metrics.BACKEND_RETRIES.labels(reason)._value.get()


FAILURES = {
    "503": (status(503, "engine is overloaded"), "unavailable"),
    "429": (status(429, "too many requests"), "overloaded"),
    "500": (status(500, "engine died"), "error"),
    "404 model": (status(404, "model smollm2 does not exist"), "model_missing"),
    "refused": (raising(lambda r: httpx.ConnectError("connection refused", request=r)), "unreachable"),
    "read timeout": (body_of(httpx.ReadTimeout("timed out")), "timeout"),
    "connection dropped": (body_of(httpx.RemoteProtocolError("peer closed connection")), "stream_broken"),
    "stream ended empty": (body_of(b"data: [DONE]\n\n"), "stream_broken"),
    "error chunk 503": (body_of(sse({"object": "error", "message": "busy", "code": 503})), "unavailable"),
    "aborted": (body_of(sse(piece("", "abort"))), "aborted"),
}


@pytest.mark.parametrize("failure", FAILURES)
async def test_a_failure_before_the_first_token_is_retried_on_the_other_replica(
    tokenizer: LocalTokenizer, spans: Spans, failure: str
) -> None:
    handler, reason = FAILURES[failure]
    servers = Replicas(a=handler, b=answers)
    backend = await make(tokenizer, servers)
    counted = retries(reason)
    events = await generate(backend)
    assert "".join(e.text for e in events) == "Paris"
    assert (events[-1].finish_reason, events[-1].input_tokens, events[-1].output_tokens) == (FINISH_LENGTH, 3, 2)
    assert servers.hits == {A: 1, B: 1}, "tried on A first, then once on B"
    assert [r.in_flight for r in backend.replicas] == [0, 0]
    assert retries(reason) == counted + 1
    assert backend.budget.retries == 1
    (span,) = spans.ended("inference.generate")
    attributes = dict(span.attributes or {})
    assert attributes["server.address"] == B, "the span names the replica that answered"
    assert attributes["llmesh.inference.retried"] is True
    (event,) = span.events
    assert event.name == "llmesh.inference.retry"
    assert dict(event.attributes or {}) == {
        "llmesh.inference.failed_replica": f"http://{A}:8000/v1",
        "llmesh.inference.replica": f"http://{B}:8000/v1",
        "error.type": reason,
    }
    assert span.status.status_code is StatusCode.UNSET, "answered: no error"
    await backend.client.aclose()


async def test_a_refused_replica_is_out_of_service_and_the_next_request_goes_to_the_other(
    tokenizer: LocalTokenizer,
) -> None:
    servers = Replicas(a=FAILURES["refused"][0], b=answers)
    backend = await make(tokenizer, servers)
    await generate(backend)
    assert not backend.replicas[0].healthy, "the health poll brings it back"
    await generate(backend)
    assert servers.hits == {A: 1, B: 2}
    await backend.client.aclose()


async def test_a_failure_after_the_first_token_goes_to_the_caller(tokenizer: LocalTokenizer) -> None:
    broken = body_of(sse(piece("Pa")), httpx.RemoteProtocolError("peer closed connection"))
    servers = Replicas(a=broken, b=answers)
    backend = await make(tokenizer, servers)
    got: list[str] = []
    with pytest.raises(errors.Unavailable) as failed:
        async for event in backend.submit([1, 2, 3], SamplingParams(max_new_tokens=2)):
            got.append(event.text)
    assert got == ["Pa"] and failed.value.reason == "BACKEND_STREAM_BROKEN"
    assert servers.hits == {A: 1}, "the caller has part of A's answer: B is never asked"
    assert backend.budget.retries == 0
    # Ended without a finish reason after a token: the same.
    servers.handlers[A] = body_of(sse(piece("Pa")) + b"data: [DONE]\n\n")
    with pytest.raises(errors.Unavailable):
        await generate(backend)
    assert servers.hits == {A: 2}
    assert [r.in_flight for r in backend.replicas] == [0, 0]
    await backend.client.aclose()


@pytest.mark.parametrize(
    ("code", "error"),
    [(400, errors.InvalidArgument), (422, errors.InvalidArgument), (401, errors.FailedPrecondition)],
)
async def test_a_request_the_server_rejects_is_not_retried(
    tokenizer: LocalTokenizer, code: int, error: type[errors.LlmeshError]
) -> None:
    servers = Replicas(a=status(code, "'seed' must be a signed 64-bit integer"), b=answers)
    backend = await make(tokenizer, servers)
    with pytest.raises(error):
        await generate(backend)
    # In the stream, before any token: the same.
    servers.handlers[A] = body_of(sse({"object": "error", "message": "bad logits_processors", "code": 400}))
    with pytest.raises(errors.InvalidArgument):
        await generate(backend)
    assert servers.hits == {A: 2}, "another replica would reject it too"
    await backend.client.aclose()


async def test_our_own_connection_pool_being_full_is_not_retried(tokenizer: LocalTokenizer) -> None:
    servers = Replicas(a=raising(lambda r: httpx.PoolTimeout("all connections busy", request=r)), b=answers)
    backend = await make(tokenizer, servers)
    with pytest.raises(errors.ResourceExhausted) as busy:
        await generate(backend)
    assert busy.value.reason == "BACKEND_CONNECTIONS_BUSY", "the pool is ours: the other replica shares it"
    assert servers.hits == {A: 1}
    await backend.client.aclose()


async def test_retried_once_only(tokenizer: LocalTokenizer) -> None:
    servers = Replicas(a=status(503), b=status(500, "engine died"), c=status(500, "engine died"))
    backend = await make(tokenizer, servers)
    with pytest.raises(errors.Unavailable) as failed:
        await generate(backend)
    assert failed.value.reason == "BACKEND_ERROR", "the second replica's error is the caller's"
    assert servers.hits[A] == 1 and sum(servers.hits.values()) == 2, "A, then one of the others"
    assert [r.in_flight for r in backend.replicas] == [0, 0, 0]
    await backend.client.aclose()


async def test_with_no_other_replica_the_error_goes_to_the_caller(tokenizer: LocalTokenizer) -> None:
    servers = Replicas(a=status(503), b=answers)
    backend = await make(tokenizer, servers)
    backend.replicas[1].listed = backend.replicas[1].healthy = False  # B does not serve the model
    with pytest.raises(errors.Unavailable):
        await generate(backend)
    assert servers.hits == {A: 1} and backend.budget.retries == 0
    # B lists the model but is silent (not healthy): with no healthy one left, it is tried.
    backend.replicas[1].listed = True
    assert "".join(e.text for e in await generate(backend)) == "Paris"
    assert servers.hits == {A: 2, B: 1}
    await backend.client.aclose()


async def test_the_retry_budget_keeps_retries_to_a_tenth_of_the_requests(tokenizer: LocalTokenizer) -> None:
    servers = Replicas(a=status(503), b=answers)
    backend = await make(tokenizer, servers)
    a, b = backend.replicas
    b.in_flight = 1  # A has fewer in flight: every request goes there first, as during an outage of A
    served = failed = 0
    for _ in range(100):
        try:
            await generate(backend)
            served += 1
        except errors.Unavailable:
            failed += 1
    # The burst (10), then a tenth of a retry per request: 10 + 99 x 0.1 (the first request's
    # tenth found the bucket full).
    assert served == backend.budget.retries == servers.hits[B] == 19
    assert failed == backend.budget.refused == 81
    assert servers.hits[A] == 100
    assert (a.in_flight, b.in_flight) == (0, 1)
    await backend.client.aclose()


async def test_a_cancelled_generation_is_not_retried(tokenizer: LocalTokenizer) -> None:
    arrived = asyncio.Event()
    never = asyncio.Event()

    async def hangs(request: httpx.Request) -> httpx.Response:
        arrived.set()
        await never.wait()
        raise AssertionError("unreachable")

    servers = Replicas(a=hangs, b=answers)
    backend = await make(tokenizer, servers)
    stream = backend.submit([1, 2, 3], SamplingParams(max_new_tokens=2))

    async def first_event() -> GenerationEvent:
        return await stream.__anext__()

    first = asyncio.create_task(first_event())
    await arrived.wait()
    assert backend.replicas[0].in_flight == 1
    first.cancel()  # the caller's deadline or cancel: the handler task is cancelled
    with pytest.raises(asyncio.CancelledError):
        await first
    stream.cancel()
    assert servers.hits == {A: 1}, "nothing is sent to B"
    assert [r.in_flight for r in backend.replicas] == [0, 0]
    assert backend.budget.retries == 0
    await backend.client.aclose()
