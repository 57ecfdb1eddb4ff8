"""Cache hits through the gateway on real servers (tokenizer, tiny-model inference, cache on
real Redis): concurrent hits share LookupBatch calls and each still gets its own answer."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import redis
from prometheus_client import REGISTRY

from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

QUESTIONS = [f"Question number {i}: what is {i} plus {i}?" for i in range(6)]


def batches_handled() -> float:
    labels = {"grpc_type": "unary", "grpc_service": "llmesh.v1.Cache", "grpc_method": "LookupBatch", "grpc_code": "OK"}
    return REGISTRY.get_sample_value("grpc_server_handled_total", labels) or 0.0


def ask(prompt: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, use_retrieval=False, sampling=common_pb2.SamplingParams(max_new_tokens=4)
    )


async def test_concurrent_hits_share_batched_lookups(
    models_dir: Path, tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    prefix = f"llmesh-gw-cache:{uuid.uuid4().hex[:8]}:"
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": redis_url,
        "QDRANT_URL": "",
        # The background store has half a second by default; a loaded 2-core runner can miss
        # that on the first store (cold connection), and this test is about lookups, not stores.
        "LLMESH_HOP_CACHE_STORE_SECONDS": "10",
    }
    try:
        async with (
            hosted("tokenizer", TokenizerApp, env) as tok,
            hosted("inference", InferenceApp, env) as inf,
            hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as cache,
        ):
            targets = {
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
            }
            async with hosted("gateway", GatewayApp, {**env, **targets}) as gw:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    first = {q: await stub.Generate(ask(q), timeout=60) for q in QUESTIONS}
                    assert not any(reply.cache.hit for reply in first.values())
                    await gw.app.gateway.settle()  # type: ignore[attr-defined]  # the stores run after the answers
                    before = batches_handled()
                    asked = [QUESTIONS[i % len(QUESTIONS)] for i in range(96)]
                    replies = await asyncio.gather(*(stub.Generate(ask(q), timeout=60) for q in asked))
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    assert all(r.cache.hit and r.cache.tier == common_pb2.CACHE_TIER_EXACT for r in replies)
    assert [r.text for r in replies] == [first[q].text for q in asked]  # each its own answer
    assert batches_handled() > before  # lookups that queued went together
