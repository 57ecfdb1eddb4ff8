"""Closed-loop streaming clients for the benchmarks: the same load over each front door.

`http_loop` streams `/v1/completions` (SSE) from any OpenAI-compatible server: the gateway's HTTP
API, or vLLM direct. `grpc_loop` streams the gateway's `GenerateStream`. Both run
bench.batching's closed loop (each client sends its next request when its previous one ended;
clients start two tokens apart) and return the same figures: tok/s, TTFT p50/p95, requests, and
requests refused for load (HTTP 429/503, RESOURCE_EXHAUSTED), each retried after the delay the
answer gives, as a client should.

Nothing is hidden from the clock: the record starts before the request is sent (a refused try
restarts it), the first token is the first event that carries text, and every byte of every
answer is read. Tokens are counted from the usage each answer ends with, spread over the
events that carried them (an event may carry more than one token).

`bench.backends` and `bench.engine` use these to report each front door apart."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from bench.batching import Record, closed_loop
from llmesh.errors import status_details, unpack_details
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

#: Statuses a server answers when it is too busy for now: retried after its Retry-After.
BUSY_STATUSES = frozenset({429, 503})


@dataclass
class Tally:
    """What one loop's clients counted besides the records: refusals retried, tokens produced."""

    sheds: int = 0
    tokens: int = 0
    answers: int = 0  # requests answered to their end (tokens / answers: tokens per answer)
    errors: list[str] = field(default_factory=list)


def sse_events(buffer: bytearray, chunk: bytes) -> list[bytes]:
    """The `data:` payloads of the complete events in `buffer` + `chunk` (the rest stays in
    `buffer` for the next chunk). Events end with a blank line; `\\r\\n` line ends are accepted."""
    buffer += chunk
    if b"\r" in buffer:
        buffer[:] = buffer.replace(b"\r\n", b"\n")
    out: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return out
        event, buffer[:] = bytes(buffer[:end]), buffer[end + 2 :]
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))


def spread(record: Record, produced: int) -> None:
    """Counts the tokens a stream really produced (its usage), spread over the events that carried them."""
    if record.arrivals and produced:
        each = produced / len(record.arrivals)
        record.arrivals = [(t, each) for t, _ in record.arrivals]  # type: ignore[misc]


def completion_body(
    model: str, max_new: int, *, ignore_eos: bool = False, extra: dict[str, Any] | None = None
) -> Callable[[Any], dict[str, Any]]:
    """The `/v1/completions` body for a prompt (text or token ids): greedy, streamed, with usage."""

    def body(prompt: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_new,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        if ignore_eos:
            out["ignore_eos"] = True  # vLLM's extension
        return out

    return body


def retry_after(headers: httpx.Headers, default: float = 0.5) -> float:
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return float(value) * scale
            except ValueError:
                continue
    return default


async def http_one(
    client: httpx.AsyncClient,
    url: str,
    body: Callable[[Any], dict[str, Any]],
    tally: Tally,
    prompt: Any,
    max_new: int,
    decoding: asyncio.Event | None = None,
    records: list[Record] | None = None,
) -> Record:
    """One streamed completion; `max_new` is in `body` already (the closed loop passes it too)."""
    payload = json.dumps(body(prompt)).encode()
    headers = {"content-type": "application/json"}
    while True:
        record = Record(time.perf_counter())
        async with client.stream("POST", url, content=payload, headers=headers) as response:
            if response.status_code in BUSY_STATUSES:
                await response.aread()
                tally.sheds += 1
                await asyncio.sleep(retry_after(response.headers))
                continue
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
            if records is not None:
                records.append(record)
            produced = 0
            buffer = bytearray()
            async for chunk in response.aiter_raw():
                now = time.perf_counter()
                for data in sse_events(buffer, chunk):
                    if data == b"[DONE]":
                        continue  # read on to the body's end: the connection goes back to the pool
                    event = json.loads(data)
                    if "error" in event:
                        raise RuntimeError(f"{url} streamed an error: {event['error']}")
                    if any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                        if record.first is None:
                            record.first = now
                        record.arrivals.append((now, 1))
                        if decoding is not None and len(record.arrivals) >= 2:
                            decoding.set()
                    if event.get("usage"):
                        produced = int(event["usage"]["completion_tokens"])
        spread(record, produced)
        tally.tokens += produced
        tally.answers += 1
        record.done = time.perf_counter()
        if decoding is not None:
            decoding.set()
        return record


def generate_request(prompt: str, max_new: int, ignore_eos: bool = False) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        use_cache=False,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos),
    )


def retry_delay(err: grpc.aio.AioRpcError, default: float = 0.5) -> float:
    """The RetryInfo delay of a refusal, `default` where it carries none."""
    retry = unpack_details(status_details(err.trailing_metadata())).get("retry_info")
    if retry is None:
        return default
    return float(retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9)  # type: ignore[attr-defined]


async def grpc_one(
    stub: gateway_pb2_grpc.GatewayStub,
    tally: Tally,
    ignore_eos: bool,
    metadata: Sequence[tuple[str, str]],
    prompt: str,
    max_new: int,
    decoding: asyncio.Event | None = None,
    records: list[Record] | None = None,
) -> Record:
    """One GenerateStream call; a refusal (RESOURCE_EXHAUSTED) is retried after its RetryInfo delay."""
    while True:
        record = Record(time.perf_counter())
        produced = 0
        call = stub.GenerateStream(generate_request(prompt, max_new, ignore_eos), timeout=600, metadata=metadata)
        try:
            first = True
            async for event in call:
                now = time.perf_counter()
                if first:
                    first = False
                    if records is not None:
                        records.append(record)
                if event.delta:
                    if record.first is None:
                        record.first = now
                    record.arrivals.append((now, 1))
                    if decoding is not None and len(record.arrivals) >= 2:
                        decoding.set()
                elif event.HasField("final"):
                    produced = event.final.usage.output_tokens
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not first:
                raise
            tally.sheds += 1
            await asyncio.sleep(retry_delay(err))
            continue
        spread(record, produced)
        tally.tokens += produced
        tally.answers += 1
        record.done = time.perf_counter()
        if decoding is not None:
            decoding.set()
        return record


def figures(loop: dict[str, float], tally: Tally) -> dict[str, float]:
    return {
        **loop,
        "sheds": tally.sheds,
        "tokens": tally.tokens,
        "tokens_per_answer": tally.tokens / max(1, tally.answers),
    }


async def http_loop(
    base_url: str,
    prompts: Sequence[Any],
    max_new: int,
    measure_s: float,
    *,
    model: str,
    api_key: str = "",
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
    settle_s: float = 5.0,
) -> dict[str, float]:
    """The closed loop over `{base_url}/completions` (base_url ends in `/v1`), one client per prompt."""
    limits = httpx.Limits(max_connections=2 * len(prompts), max_keepalive_connections=2 * len(prompts))
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = completion_body(model, max_new, ignore_eos=ignore_eos, extra=extra_body)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=10.0), headers=headers) as client:
        url = f"{base_url}/completions"
        await http_one(client, url, completion_body(model, 8, extra=extra_body), Tally(), prompts[0], 8)  # warm-up
        tally = Tally()
        run = functools.partial(http_one, client, url, body, tally)
        loop = await closed_loop(run, list(prompts), lambda rng: max_new, measure_s, settle_s)
    return figures(loop, tally)


async def grpc_loop(
    target: str,
    prompts: Sequence[str],
    max_new: int,
    measure_s: float,
    *,
    api_key: str = "",
    ignore_eos: bool = False,
    settle_s: float = 5.0,
) -> dict[str, float]:
    """The closed loop over the gateway's GenerateStream, one client per prompt."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await grpc_one(stub, Tally(), ignore_eos, metadata, prompts[0], 8)
        tally = Tally()
        run = functools.partial(grpc_one, stub, tally, ignore_eos, metadata)
        loop = await closed_loop(run, list(prompts), lambda rng: max_new, measure_s, settle_s)
    return figures(loop, tally)
