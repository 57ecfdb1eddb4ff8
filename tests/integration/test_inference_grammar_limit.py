"""A response format's grammar is compiled off the event loop, within LLMESH_GRAMMAR_COMPILE_SECONDS:
past it the request is refused INVALID_ARGUMENT naming the field, the compile finishes on its own
thread, and the same format is then served from the compiled grammars."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from llmesh.server import ServiceHost
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.engine.decoding import ResponseFormatSpec
from services.inference.servicer import InferenceApp, format_from_proto

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def host(tiny_model: Path, models_dir: Path) -> AsyncIterator[ServiceHost]:
    env = {
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DEVICE": "cpu",
        # Shorter than any schema of some size takes to compile: the limit, not the machine, decides.
        "LLMESH_GRAMMAR_COMPILE_SECONDS": "0.001",
    }
    async with hosted("inference", InferenceApp, env=env) as h:
        yield h


def schema_request() -> inference_pb2.InferenceRequest:
    properties = {f"field_{i}": {"type": "object", "properties": {"a": {"enum": ["x", str(i)]}}} for i in range(200)}
    form = common_pb2.ResponseFormat(
        type="json_schema", json_schema=json.dumps({"type": "object", "properties": properties})
    )
    return inference_pb2.InferenceRequest(
        text="Fill the form", sampling=common_pb2.SamplingParams(max_new_tokens=8), response_format=form
    )


async def test_a_slow_compile_is_refused_naming_the_field_then_served_once_compiled(host: ServiceHost) -> None:
    request = schema_request()
    spec = format_from_proto(request.response_format)
    assert isinstance(spec, ResponseFormatSpec)
    engine = host.app.manager.get().engine  # type: ignore[attr-defined]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(request, timeout=30):
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "response_format.json_schema" in (refused.value.details() or "")
        assert "LLMESH_GRAMMAR_COMPILE_SECONDS" in (refused.value.details() or "")
        # The compile went on on its thread; once done, the format is served from the library.
        grammars = engine.grammars()
        while not grammars.holds(spec):
            await asyncio.to_thread(engine._compiler.submit(lambda: None).result)
        answers = [m async for m in stub.Generate(request, timeout=60)]
        assert answers and answers[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
