"""A frozen openai backend replica: one that answers nothing (a SIGSTOPped vLLM accepts
connections and never answers) is out of service after `silence_s`, not after the /models poll's
timeout; its first answer (a /metrics scrape counts) brings it back; each change is announced at
once (`wait_changed`), and a load watch sends no report while the backend does not serve."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from llmesh import errors
from services.inference.engine.decoding import SamplingParams
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend
from services.inference.servicer import InferenceApp

URL = "http://10.0.0.1:8000/v1"
OTHER = "http://10.0.0.2:8000/v1"
MODELS = {"data": [{"id": "smollm2", "max_model_len": 2048, "owned_by": "vllm"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Server:
    """A fake vLLM: answers, or hangs every request (frozen) until thawed."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.requests: list[str] = []

    def freeze(self) -> None:
        self.thawed.clear()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request.url.path)
        await self.thawed.wait()
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json=MODELS)
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        return httpx.Response(200, text="vllm:num_requests_running 0\n")


@pytest.fixture
def tokenizer(models_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(models_dir, "smollm2")


async def make(
    tokenizer: LocalTokenizer, server: Server, clock: Clock, urls: tuple[str, ...] = (URL,)
) -> OpenAIBackend:
    backend = OpenAIBackend(BackendConfig(urls=urls, model="smollm2", silence_s=0.4), tokenizer, clock=clock)
    await backend.client.aclose()
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    return backend


async def test_a_silent_replica_is_out_after_silence_s_and_back_on_its_first_answer(
    tokenizer: LocalTokenizer,
) -> None:
    server, clock = Server(), Clock()
    backend = await make(tokenizer, server, clock)
    assert await backend.check_health()
    replica = backend.replicas[0]
    await backend.wait_changed()  # it came up: announced
    for _ in range(4):  # answering every 0.1 s: never silent
        clock.now += 0.1
        await backend._scrape(replica)
        backend.check_silence()
    assert backend.serving
    server.freeze()
    scrape = asyncio.create_task(backend._scrape(replica))  # hangs, as on a SIGSTOPped vLLM
    for _ in range(3):
        clock.now += 0.1
        backend.check_silence()
    assert backend.serving, "0.3 s of silence is not yet a freeze"
    clock.now += 0.11
    backend.check_silence()
    assert not backend.serving, "0.41 s without an answer: out of service (the /models poll would take 3 s)"
    assert replica.listed
    await asyncio.wait_for(backend.wait_changed(), 1)  # announced at once
    assert backend._pick() is replica, "with no healthy replica a listed one still takes work (it may be slow)"
    server.thawed.set()  # SIGCONT: the hanging scrape is answered
    await scrape
    assert backend.serving, "its first answer (a /metrics scrape) brings it back"
    await asyncio.wait_for(backend.wait_changed(), 1)
    await backend.client.aclose()


async def test_a_probe_that_times_out_leaves_the_judgement_to_the_silence_watch(tokenizer: LocalTokenizer) -> None:
    server, clock = Server(), Clock()
    backend = await make(tokenizer, server, clock)
    assert await backend.check_health()
    replica = backend.replicas[0]

    async def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(timeout))
    await backend.check_health()
    assert replica.listed, "a timeout is silence, not a refusal: the replica still lists the model"
    clock.now += 0.5
    backend.check_silence()
    assert not replica.healthy
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    await backend._scrape(replica)  # the load poll keeps scraping a listed replica
    assert replica.healthy


async def test_a_late_silence_check_holds_its_judgement(tokenizer: LocalTokenizer) -> None:
    """Our own loop lagged (the answers may be waiting unread): no verdict for a silence period."""
    server, clock = Server(), Clock()
    backend = await make(tokenizer, server, clock)
    assert await backend.check_health()
    backend.check_silence()
    clock.now += 1.0  # the check comes 1 s late
    backend.check_silence()
    assert backend.serving
    for _ in range(3):  # on time again, but within the hold
        clock.now += 0.1
        backend.check_silence()
        assert backend.serving
    clock.now += 0.15  # past the hold, still nothing heard
    backend.check_silence()
    assert not backend.serving


async def test_one_frozen_replica_does_not_stall_the_others_load(tokenizer: LocalTokenizer) -> None:
    frozen = asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.1" and request.url.path.startswith("/metrics"):
            await frozen.wait()
        return await Server().handle(request)

    clock = Clock()
    backend = await make(tokenizer, Server(), clock, urls=(URL, OTHER))
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    assert await backend.check_health()
    scraped = asyncio.Event()
    other = backend.replicas[1]
    real_answered = backend._answered

    def answered(replica: Any) -> None:
        real_answered(replica)
        if replica is other:
            scraped.set()

    backend._answered = answered  # type: ignore[method-assign]
    polls = [asyncio.create_task(backend._poll_load(r)) for r in backend.replicas]
    await asyncio.wait_for(scraped.wait(), 5)
    for task in polls:
        task.cancel()
    frozen.set()
    await backend.client.aclose()


async def test_the_app_announces_its_backends_changes(tokenizer: LocalTokenizer) -> None:
    server, clock = Server(), Clock()
    backend = await make(tokenizer, server, clock)
    app = InferenceApp(SimpleNamespace())  # type: ignore[arg-type]
    app.manager.set(backend)  # type: ignore[arg-type]
    waiting = asyncio.create_task(app.wait_changed())
    assert await backend.check_health()
    await asyncio.wait_for(waiting, 1)
    assert app.serving
    await backend.client.aclose()


async def test_a_streams_chunks_are_answers_too(tokenizer: LocalTokenizer) -> None:
    """A replica busy streaming tokens is alive even while its /metrics is slow to answer."""
    clock = Clock()
    chunks = [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions"):
            clock.now += 0.5  # the answer starts after 0.5 s of nothing else heard
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
        return await Server().handle(request)

    backend = await make(tokenizer, Server(), clock)
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    assert await backend.check_health()
    events = [e async for e in backend.submit([1, 2], SamplingParams(max_new_tokens=2))]
    assert events[-1].finish_reason is not None
    backend.check_silence()
    assert backend.serving, "its chunks were answers: not silent"
    for _ in range(5):
        clock.now += 0.1
        backend.check_silence()
    assert not backend.serving, "then nothing for 0.5 s"
    await backend.client.aclose()


async def test_a_silent_replica_gets_work_only_when_no_healthy_one_is_left(tokenizer: LocalTokenizer) -> None:
    clock = Clock()
    backend = await make(tokenizer, Server(), clock, urls=(URL, OTHER))
    assert await backend.check_health()
    slow, fine = backend.replicas
    fine.answered_at = clock.now + 0.3
    for _ in range(5):
        clock.now += 0.1
        backend.check_silence()
    assert not slow.healthy and fine.healthy
    assert all(backend._pick() is fine for _ in range(4))
    fine.listed = fine.healthy = False  # the other one no longer lists the model
    assert backend._pick() is slow
    slow.listed = False
    with pytest.raises(errors.Unavailable):
        backend._pick()
    await backend.client.aclose()
