"""The openai backend sends a batch request's priority as vLLM's own `priority` field, only where
the backend is said to schedule by it (LLMESH_BACKEND_PRIORITY): vLLM refuses the field under
its default first-come-first-served policy. The replica is an `httpx.MockTransport` handler that
records the request bodies it was sent."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.inference.engine.decoding import SamplingParams
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend

ANSWER = (
    b'data: {"id":"c1","model":"smollm2","choices":[{"text":"Hi","finish_reason":"length"}]}\n\n'
    b'data: {"id":"c1","model":"smollm2","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(models_dir, "smollm2")


async def bodies_sent(tokenizer: LocalTokenizer, send_priority: bool, priority: int) -> list[dict]:
    sent: list[dict] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=ANSWER)

    config = BackendConfig(urls=("http://10.0.0.1:8000/v1",), model="smollm2", send_priority=send_priority)
    backend = OpenAIBackend(config, tokenizer)
    await backend.client.aclose()
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    for replica in backend.replicas:
        replica.listed = replica.healthy = True
    try:
        events = [e async for e in backend.submit([1, 2, 3], SamplingParams(max_new_tokens=1), priority=priority)]
        assert events[-1].finish_reason
    finally:
        await backend.client.aclose()
    return sent


async def test_a_batch_request_carries_vllms_priority_field(tokenizer: LocalTokenizer) -> None:
    (body,) = await bodies_sent(tokenizer, send_priority=True, priority=1)
    assert body["priority"] == 1


async def test_interactive_requests_and_fcfs_backends_get_no_priority_field(tokenizer: LocalTokenizer) -> None:
    (interactive,) = await bodies_sent(tokenizer, send_priority=True, priority=0)
    (fcfs,) = await bodies_sent(tokenizer, send_priority=False, priority=1)
    assert "priority" not in interactive and "priority" not in fcfs
