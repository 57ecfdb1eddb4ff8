"""The inference service over real gRPC, in-process on port 0, with the tiny model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from llmesh import telemetry
from llmesh.errors import status_details, unpack_details
from llmesh.server import ServiceHost
from llmesh.testing import eventually, hosted
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.engine import Engine
from services.inference.servicer import InferenceApp

MAX_PROMPT = 64
MAX_BATCH = 4
MAX_QUEUE = 2


@pytest.fixture(scope="module")
async def host(tiny_model: Path, models_dir: Path) -> AsyncIterator[ServiceHost]:
    env = {
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DEVICE": "cpu",
        "LLMESH_MAX_PROMPT_TOKENS": str(MAX_PROMPT),
        "LLMESH_MAX_BATCH_SIZE": str(MAX_BATCH),
        "LLMESH_MAX_QUEUE": str(MAX_QUEUE),
        "LLMESH_ADMIN_TOKEN": "",
    }
    async with hosted("inference", InferenceApp, env=env) as h:
        yield h


@pytest.fixture(scope="module")
async def stub(host: ServiceHost) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def engine_of(host: ServiceHost) -> Engine:
    return host.app.manager.get().engine  # type: ignore[attr-defined,no-any-return]


def request(text: str = "Hello there", **sampling: object) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(text=text, sampling=common_pb2.SamplingParams(**sampling))


async def collect(
    stub: inference_pb2_grpc.InferenceStub, req: inference_pb2.InferenceRequest
) -> list[inference_pb2.InferenceResponse]:
    return [m async for m in stub.Generate(req, timeout=30)]


async def test_generate_streams_tokens_then_finish_and_usage(
    stub: inference_pb2_grpc.InferenceStub, host: ServiceHost
) -> None:
    messages = await collect(stub, request("Hello there", max_new_tokens=12, ignore_eos=True))
    last = messages[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    ids = [i for m in messages for i in m.token_ids]
    prompt = engine_of(host).encode("Hello there")
    assert last.usage.input_tokens == len(prompt)
    assert last.usage.output_tokens == len(ids) == 12
    assert "".join(m.text for m in messages) == engine_of(host).model.decode(ids)
    assert last.batch_id and all(m.batch_id == last.batch_id for m in messages)

    # The same prompt as token ids gives the same greedy tokens.
    again = await collect(
        stub,
        inference_pb2.InferenceRequest(
            token_ids=inference_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_new_tokens=12, ignore_eos=True),
        ),
    )
    assert [i for m in again for i in m.token_ids] == ids


async def test_model_info(stub: inference_pb2_grpc.InferenceStub, tiny_model: Path) -> None:
    from llmesh.models import verify

    info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    verified = verify(tiny_model)
    assert (info.version, info.sha256, info.model_id) == (verified.version, verified.digest, verified.model_id)
    # LLMESH_DTYPE=auto: the hardware rule (bfloat16 where this CPU has native bf16).
    import torch

    from llmesh.hardware import choose_dtype

    assert (info.device, info.dtype) == ("cpu", choose_dtype(torch.device("cpu")).name)
    assert info.max_context_tokens == 2048 and info.max_batch_size == MAX_BATCH


async def test_over_long_prompt_is_invalid_argument_naming_the_limit(stub: inference_pb2_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("word " * 200))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = unpack_details(status_details(info.value.trailing_metadata()))
    violations = {v.field: v.description for v in details["bad_request"].field_violations}  # type: ignore[attr-defined]
    assert f"limit is {MAX_PROMPT}" in violations["input"]
    assert "LLMESH_MAX_PROMPT_TOKENS" in violations["input"]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(temperature=2.5, top_p=1.5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = unpack_details(status_details(info.value.trailing_metadata()))
    fields = {v.field for v in details["bad_request"].field_violations}  # type: ignore[attr-defined]
    assert fields == {"sampling.temperature", "sampling.top_p"}

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, inference_pb2.InferenceRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stop_string_over_grpc(stub: inference_pb2_grpc.InferenceStub) -> None:
    full = "".join(m.text for m in await collect(stub, request("Once", max_new_tokens=30, ignore_eos=True)))
    stop = full[8:11]
    messages = await collect(stub, request("Once", max_new_tokens=30, ignore_eos=True, stop=[stop]))
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE
    assert "".join(m.text for m in messages) == full[: full.find(stop)]


async def test_full_queue_is_resource_exhausted_at_once_with_retry_info(
    stub: inference_pb2_grpc.InferenceStub, host: ServiceHost
) -> None:
    engine = engine_of(host)
    long = request("Hi", max_new_tokens=500, ignore_eos=True)
    calls = [stub.Generate(long) for _ in range(MAX_BATCH)]
    try:
        for call in calls:
            await call.read()  # running
        calls += [stub.Generate(long) for _ in range(MAX_QUEUE)]
        await eventually(lambda: engine.waiting_count == MAX_QUEUE, 5.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, long)
        # At once: refused on arrival (QUEUE_FULL, below), not after a wait for a row, since the
        # 500-token requests that hold every row are all still going.
        assert engine.running_count == MAX_BATCH
    finally:
        for call in calls:
            call.cancel()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = unpack_details(status_details(info.value.trailing_metadata()))
    retry = details["retry_info"].retry_delay  # type: ignore[attr-defined]
    assert retry.seconds + retry.nanos / 1e9 > 0
    assert details["error_info"].reason == "QUEUE_FULL"  # type: ignore[attr-defined]
    assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"]
    await eventually(lambda: engine.running_count == 0 and engine.waiting_count == 0, 5.0)


async def test_client_cancel_frees_the_slot_within_a_step(
    stub: inference_pb2_grpc.InferenceStub, host: ServiceHost
) -> None:
    engine = engine_of(host)
    cancelled = REGISTRY.get_sample_value("llmesh_inference_requests_total", {"outcome": "cancelled"}) or 0
    call = stub.Generate(request("Hi", max_new_tokens=500, ignore_eos=True))
    await call.read()
    await call.read()
    assert engine.running_count == 1
    steps = engine.steps
    call.cancel()
    await eventually(lambda: engine.running_count == 0, 5.0)
    # The row left at a step boundary, far short of the 500 tokens asked. How many steps the
    # cancellation took to reach the worker depends on the machine (a tiny model's step is a
    # millisecond), so the bound is on the work left undone, not on a count of steps.
    assert engine.steps - steps < 100
    assert REGISTRY.get_sample_value("llmesh_inference_batch_size") == 0
    await eventually(
        lambda: REGISTRY.get_sample_value("llmesh_inference_requests_total", {"outcome": "cancelled"}) == cancelled + 1,
        5.0,
    )


async def test_deadline_cancels_the_sequence(stub: inference_pb2_grpc.InferenceStub, host: ServiceHost) -> None:
    engine = engine_of(host)
    held = threading.Event()
    release = threading.Event()

    def hold(kind: str, rows: int) -> None:
        # The engine stops before its first decode step until the test lets it go: the deadline
        # passes while the sequence runs, however fast the engine.
        if kind == "decode" and not release.is_set():
            held.set()
            release.wait(30)

    engine.fault_hook = hold
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(request("Hi", max_new_tokens=500, ignore_eos=True), timeout=1.0):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert held.is_set() and engine.running_count == 1  # it was running when the deadline came
    finally:
        engine.fault_hook = None
        release.set()
    await eventually(lambda: engine.running_count == 0, 5.0)


async def test_admin_disabled_without_a_token(stub: inference_pb2_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadModel(inference_pb2.LoadModelRequest(version="v1"), metadata=(("authorization", "Bearer "),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_metrics_and_spans(stub: inference_pb2_grpc.InferenceStub) -> None:
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("inference").add_span_processor(SimpleSpanProcessor(exporter))
    count = REGISTRY.get_sample_value("llmesh_inference_time_to_first_token_seconds_count") or 0
    generated = REGISTRY.get_sample_value("llmesh_inference_generation_tokens_total") or 0
    results = await asyncio.gather(
        *(
            collect(stub, request(f"Hello {i}", max_new_tokens=6, ignore_eos=True, temperature=0.5, seed=i))
            for i in range(3)
        )
    )
    assert REGISTRY.get_sample_value("llmesh_inference_time_to_first_token_seconds_count") == count + 3
    assert REGISTRY.get_sample_value("llmesh_inference_generation_tokens_total") == generated + 18
    assert REGISTRY.get_sample_value("llmesh_inference_requests_total", {"outcome": "length"})

    def all_exported() -> bool:
        """Spans reach processors from a background thread (llmesh.spans), each when it ends: wait
        for the three request spans, their gRPC server parents and the batch spans they link to."""
        spans = exporter.get_finished_spans()
        ids = {s.context.span_id for s in spans}
        batches = {(s.attributes or {}).get("llmesh.batch.id") for s in spans if s.name == "inference.batch"}
        generated = [s for s in spans if s.name == "inference.generate"]
        return len(generated) == 3 and all(
            s.parent is not None and s.parent.span_id in ids and (s.attributes or {})["llmesh.batch.id"] in batches
            for s in generated
        )

    await eventually(all_exported, 5.0)
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    requests = [s for s in spans if s.name == "inference.generate"]
    batch_ids = {r[-1].batch_id for r in results}
    for span in requests:
        attrs = span.attributes or {}
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.request.max_tokens"] == 6
        assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
        assert attrs["gen_ai.usage.output_tokens"] == 6 and attrs["gen_ai.usage.input_tokens"] > 0
        assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]
        assert attrs["llmesh.batch.id"] in batch_ids
        # A child of the gRPC server span.
        assert span.parent is not None
        parent = by_id[span.parent.span_id]
        assert parent.kind == trace.SpanKind.SERVER and parent.name.endswith("/Generate")
        # Linked to the batch it ran in; the batch span links back.
        batch_span = next(
            s
            for s in spans
            if s.name == "inference.batch" and (s.attributes or {})["llmesh.batch.id"] == attrs["llmesh.batch.id"]
        )
        assert any(link.context.span_id == batch_span.context.span_id for link in span.links)
        assert any(link.context.span_id == span.context.span_id for link in batch_span.links)
        children = {s.name for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id}
        assert children == {"inference.queue", "inference.prefill", "inference.decode"}


async def test_logprobs_over_grpc_one_entry_per_token_and_top_logprobs_validated(
    stub: inference_pb2_grpc.InferenceStub, host: ServiceHost
) -> None:
    messages = await collect(
        stub, request("Hello there", max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    )
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    entries = [entry for m in messages for entry in m.logprobs]
    ids = [i for m in messages for i in m.token_ids]
    assert [e.token_id for e in entries] == ids and len(ids) == 6
    tokenizer = engine_of(host).model.tokenizer
    assert b"".join(e.bytes for e in entries).decode() == tokenizer.decode(ids)
    for entry in entries:
        assert entry.logprob <= 0.0 and len(entry.top) == 3
        # Greedy: the chosen token is the likeliest, and the alternatives come likeliest first.
        assert entry.top[0].token_id == entry.token_id and entry.top[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
        assert all(t.token == t.bytes.decode("utf-8", "replace") for t in entry.top)
    # Not asked: no entries.
    plain = await collect(stub, request("Hello there", max_new_tokens=6, ignore_eos=True))
    assert [i for m in plain for i in m.token_ids] == ids and not any(m.logprobs for m in plain)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(logprobs=True, top_logprobs=21))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = unpack_details(status_details(info.value.trailing_metadata()))
    assert [v.field for v in details["bad_request"].field_violations] == ["sampling.top_logprobs"]  # type: ignore[attr-defined]
