"""A fast subset of the reliability suite's bad-input fuzz (bench/reliability.py), in-process
against the gateway with its downstreams unreachable: every crafted malformed request (invalid
UTF-8, wrong wire types, unknown fields, NaN/inf, negative and oversize values, huge repeated
fields) and a few hundred random ones get a clean status, never INTERNAL or UNKNOWN, and the
gateway keeps serving."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.bad_inputs import GENERATE, INGEST, SEARCH, STREAM, BadInput, crafted_inputs, random_inputs, send_raw
from llmesh.errors import InvalidArgument
from llmesh.testing import hosted
from llmesh.v1 import gateway_pb2
from services.gateway.core import GatewayConfig, validate
from services.gateway.servicer import GatewayApp

pytestmark = pytest.mark.timeout(60)

CLOSED = "127.0.0.1:1"  # nothing listens there: requests that pass the gateway's checks get UNAVAILABLE
ENV = {
    "LLMESH_TOKENIZER_TARGET": CLOSED,
    "LLMESH_INFERENCE_TARGET": CLOSED,
    "LLMESH_CACHE_TARGET": CLOSED,
    "LLMESH_RETRIEVAL_TARGET": CLOSED,
}
REQUEST_TYPES = {
    GENERATE: gateway_pb2.GenerateRequest,
    STREAM: gateway_pb2.GenerateRequest,
    INGEST: gateway_pb2.IngestRequest,
    SEARCH: gateway_pb2.SearchRequest,
}


def expected_codes(item: BadInput, config: GatewayConfig) -> set[str]:
    """INVALID_ARGUMENT where the gateway itself can tell the request is bad; otherwise any clean
    answer (the unreachable downstreams make it UNAVAILABLE)."""
    try:
        request = REQUEST_TYPES[item.method].FromString(item.payload)
    except DecodeError:
        return {"INVALID_ARGUMENT"}
    if item.method in (GENERATE, STREAM):
        try:
            validate(request, config)  # type: ignore[arg-type]
        except InvalidArgument:
            return {"INVALID_ARGUMENT"}
    if item.method == SEARCH and not request.query.strip():  # type: ignore[attr-defined]
        return {"INVALID_ARGUMENT"}
    return {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "OK"}


# Requests with thousands of bad items: the error must still fit the caller's metadata limit.
MANY_BAD_ITEMS = ("sampling.stop:20k_empty",)


async def run_inputs(inputs: list[BadInput]) -> tuple[list[str], bool]:
    """Statuses outside what each input should get, and whether the gateway still serves."""
    async with hosted("gateway", GatewayApp, ENV) as gw:
        config = gw.app.gateway.config  # type: ignore[attr-defined]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            semaphore = asyncio.Semaphore(16)

            async def one(item: BadInput) -> tuple[BadInput, str, str]:
                async with semaphore:
                    code, details = await send_raw(channel, item, timeout=10)
                return item, code, details

            results = await asyncio.gather(*(one(item) for item in inputs))
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    wrong = [
        f"{item.method.rsplit('/', 1)[1]} {item.label}: {code} {details[:120]!r}"
        for item, code, details in results
        if code not in expected_codes(item, config)
    ]
    return wrong, health.status == health_pb2.HealthCheckResponse.SERVING


async def test_malformed_requests_get_clean_statuses_and_the_gateway_survives() -> None:
    crafted = [i for i in crafted_inputs(heavy=False) if i.label not in MANY_BAD_ITEMS]
    inputs = crafted + random_inputs(200, random.Random(11))
    wrong, serving = await run_inputs(inputs)
    assert not wrong, f"{len(wrong)} of {len(inputs)} bad inputs got an unexpected status:\n" + "\n".join(wrong[:20])
    assert serving
    assert len(inputs) >= 700


async def test_thousands_of_bad_items_still_get_invalid_argument() -> None:
    # 20,000 empty stop sequences give 20,000 field violations: unbounded, the status is ~850 KB of
    # trailing metadata and the client drops it with RESOURCE_EXHAUSTED "metadata size exceeds".
    inputs = [i for i in crafted_inputs(heavy=False) if i.label in MANY_BAD_ITEMS]
    wrong, serving = await run_inputs(inputs)
    assert inputs and not wrong, "\n".join(wrong)
    assert serving
