"""Admission from the engines' own load, on real servers: the tiny model's inference
reports its load on WatchLoad, and the gateway admits a burst its engine can serve whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from llmesh.server import ServiceHost
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

CLOSED = "127.0.0.1:1"


@contextlib.asynccontextmanager
async def mesh(models_dir: Path, **gateway: str) -> AsyncIterator[tuple[ServiceHost, ServiceHost]]:
    env = {"LLMESH_MODELS_DIR": str(models_dir), "LLMESH_INFERENCE_MODEL": "tiny"}
    async with hosted("tokenizer", TokenizerApp, env) as tok, hosted("inference", InferenceApp, env) as inf:
        gw_env = {
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
            **gateway,
        }
        async with hosted("gateway", GatewayApp, gw_env) as gw:
            yield inf, gw


def ask(prompt: str, max_new_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        use_cache=False,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def test_watch_load_reports_at_once_and_on_change(models_dir: Path, tiny_model: Path) -> None:
    env = {"LLMESH_MODELS_DIR": str(models_dir), "LLMESH_INFERENCE_MODEL": "tiny", "LLMESH_MAX_BATCH_SIZE": "4"}
    async with hosted("inference", InferenceApp, env) as inf:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{inf.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            watch = stub.WatchLoad(inference_pb2.WatchLoadRequest(max_interval_seconds=30))
            first = await watch.read()
            assert first.reported and first.model_id and first.replica
            assert (first.running, first.waiting, first.max_running, first.sequence) == (0, 0, 4, 1)
            # KV in blocks: all free while idle (cached prefixes count as free, being evictable).
            assert first.kv_blocks_free == first.kv_blocks_total > 0 and first.block_tokens > 0
            request = inference_pb2.InferenceRequest(
                text="Hello there", sampling=common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True)
            )
            generate = stub.Generate(request)
            busy = await watch.read()  # pushed on change, not at the 30 s interval
            while busy.running == 0:
                busy = await watch.read()
            assert busy.running == 1 and busy.kv_blocks_free < first.kv_blocks_total and busy.sequence > first.sequence
            generate.cancel()
            watch.cancel()
            bad = stub.WatchLoad(inference_pb2.WatchLoadRequest(min_interval_seconds=-1))
            try:
                await bad.read()
                raise AssertionError("a negative interval was accepted")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "min_interval_seconds" in (err.details() or "")


async def test_a_burst_within_the_engines_batch_room_is_served_whole(models_dir: Path, tiny_model: Path) -> None:
    # The engine has 32 free rows; the learned in-flight limit of a cold gateway (65,536 weight)
    # held fewer than half of 16 requests for 256 tokens and shed the rest.
    async with mesh(models_dir) as (_inf, gw), grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        app: GatewayApp = gw.app  # type: ignore[assignment]
        await asyncio.wait_for(app.load_watchers[0].connected.wait(), 10)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        prompt = "Tell me a long story about a lighthouse keeper and the sea, with many details."
        for count, tokens in ((16, 256), (32, 64)):
            replies = await asyncio.gather(
                *(stub.Generate(ask(prompt, tokens), timeout=120) for _ in range(count)), return_exceptions=True
            )
            failures = [r for r in replies if isinstance(r, BaseException)]
            assert not failures, f"{len(failures)} of {count} refused: {failures[0]}"
            assert all(r.usage.output_tokens == tokens for r in replies)  # type: ignore[union-attr]
