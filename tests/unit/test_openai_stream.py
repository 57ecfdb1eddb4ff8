"""The openai backend's stream: the chunks one socket read brings are one event, nothing waits
for more, and the final event carries the finish reason and the server's usage."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from services.inference.engine import FINISH_LENGTH
from services.inference.engine.decoding import SamplingParams
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def piece(text: str, finish: str | None = None) -> bytes:
    return sse({"id": "c1", "model": "smollm2", "choices": [{"text": text, "finish_reason": finish}]})


USAGE = sse({"id": "c1", "model": "smollm2", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})


def backend_reading(models_dir: Path, reads: list[bytes], sent: list[int]) -> OpenAIBackend:
    """A backend whose server answers with `reads`, one socket read each; `sent` counts the
    reads handed over when each event comes out."""

    async def body() -> AsyncIterator[bytes]:
        for raw in reads:
            sent[0] += 1
            yield raw

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    backend = OpenAIBackend(
        BackendConfig(urls=("http://vllm:8000/v1",), model="smollm2"), LocalTokenizer.load(models_dir, "smollm2")
    )
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    backend.replicas[0].healthy = True
    return backend


async def test_the_chunks_of_one_read_are_one_event_and_none_waits_for_the_next(models_dir: Path) -> None:
    reads = [piece("Pa") + piece("ris"), piece(" is"), piece("!", "length") + USAGE + b"data: [DONE]\n\n"]
    sent = [0]
    backend = backend_reading(models_dir, reads, sent)
    got = []
    async for event in backend.submit([1, 2, 3], SamplingParams(max_new_tokens=4)):
        got.append((event.text, event.finish_reason, event.input_tokens, event.output_tokens, sent[0]))
    await backend.client.aclose()
    assert got == [
        ("Paris", None, 0, 0, 1),  # out before the second read was asked for
        (" is", None, 0, 0, 2),
        ("!", None, 0, 0, 3),
        ("", FINISH_LENGTH, 3, 4, 3),
    ]
    assert backend.replicas[0].in_flight == 0


async def test_an_event_split_across_reads_comes_out_once_whole(models_dir: Path) -> None:
    whole = piece("Hello") + piece(" you", "length") + USAGE + b"data: [DONE]\n\n"
    reads = [whole[:9], whole[9:40], whole[40:]]
    backend = backend_reading(models_dir, reads, [0])
    texts = [event.text async for event in backend.submit([1, 2, 3], SamplingParams(max_new_tokens=2))]
    await backend.client.aclose()
    assert texts[-1] == ""
    assert "".join(texts) == "Hello you"
