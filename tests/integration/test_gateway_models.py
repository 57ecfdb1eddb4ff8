"""Two models behind one gateway on real servers: one tokenizer service serving both models'
tokenizers by name, one inference service per model (tiny random-weight models, different
seeds), the cache on real Redis. Requests route by `model`; each model has its own cache scope,
breaker and in-flight limit; one model's inference stopped leaves the other answering."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from llmesh import cli
from llmesh.client import AsyncMesh, MeshError
from llmesh.errors import status_details, unpack_details
from llmesh.server import ServiceHost
from llmesh.settings import SettingsError, load, model_routes
from llmesh.testing import build_tiny_model, hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

SMALL, OTHER = "tiny", "tiny-seed1"


@pytest.fixture(scope="module")
def two_models(models_dir: Path) -> tuple[str, str]:
    """Two tiny random-weight models on the real tokenizer, different weights, in the models dir."""
    build_tiny_model(models_dir, name=SMALL, seed=0)
    build_tiny_model(models_dir, name=OTHER, seed=1)
    return SMALL, OTHER


def ask(prompt: str, model: str = "", **kw: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        use_retrieval=False,
        model=model,
        sampling=common_pb2.SamplingParams(max_new_tokens=6),
        **kw,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def two_model_mesh(
    models_dir: Path, data_dir: Path, prefix: str, redis_url: str
) -> AsyncIterator[tuple[ServiceHost, ServiceHost, ServiceHost, ServiceHost]]:
    """(tokenizer, inference of SMALL, inference of OTHER, gateway routing to both)."""
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(data_dir),
        "LLMESH_REDIS_URL": redis_url,
        "QDRANT_URL": "",
        "LLMESH_TOKENIZER_MODELS": f"{SMALL},{OTHER}",
    }
    async with (
        hosted("tokenizer", TokenizerApp, env) as tok,
        hosted("inference", InferenceApp, {**env, "LLMESH_INFERENCE_MODEL": SMALL}) as small,
        hosted("inference", InferenceApp, {**env, "LLMESH_INFERENCE_MODEL": OTHER}) as other,
        hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as cache,
    ):
        targets = {
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_MODELS": f"{SMALL}=127.0.0.1:{small.port},{OTHER}=127.0.0.1:{other.port}",
            # Not dialled when LLMESH_MODELS lists the models.
            "LLMESH_INFERENCE_TARGET": "127.0.0.1:1",
            "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
            "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
            "LLMESH_BREAKER_WINDOW": "2",
            "LLMESH_BREAKER_MINIMUM_CALLS": "2",
            "LLMESH_BREAKER_WAIT_SECONDS": "30",
        }
        async with hosted("gateway", GatewayApp, {**env, **targets}) as gw:
            yield tok, small, other, gw


@pytest.fixture
def prefix(redis_url: str) -> AsyncIterator[str]:  # type: ignore[misc]
    prefix = f"llmesh-models:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


async def test_two_models_answer_by_name_with_their_own_cache_and_breaker(
    models_dir: Path, two_models: tuple[str, str], tmp_path: Path, prefix: str, redis_url: str
) -> None:
    async with two_model_mesh(models_dir, tmp_path, prefix, redis_url) as (_, _, other, gw):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            question = "Name a colour of the sky."
            a = await stub.Generate(ask(question, SMALL), timeout=60)
            b = await stub.Generate(ask(question, OTHER), timeout=60)
            default = await stub.Generate(ask("Something else entirely?"), timeout=60)
            # Each answer comes from its own model: the key names it, and the weights differ.
            assert a.model.startswith(f"{SMALL}:tiny-random-llama-0@"), a.model
            assert b.model.startswith(f"{OTHER}:tiny-random-llama-1@"), b.model
            assert default.model == a.model  # the first listed is the default
            assert a.text and b.text and a.text != b.text
            assert not a.cache.hit and not b.cache.hit
            await gw.app.gateway.settle()  # type: ignore[attr-defined]

            # A cached answer of one model never serves the other.
            again_a = await stub.Generate(ask(question, SMALL), timeout=60)
            again_b = await stub.Generate(ask(question, OTHER), timeout=60)
            assert again_a.cache.hit and again_a.text == a.text and again_a.model == a.model
            assert again_b.cache.hit and again_b.text == b.text and again_b.model == b.model
            await gw.app.gateway.settle()  # type: ignore[attr-defined]
            fresh = "A question only the small model was asked."
            first = await stub.Generate(ask(fresh, SMALL), timeout=60)
            await gw.app.gateway.settle()  # type: ignore[attr-defined]
            assert (await stub.Generate(ask(fresh, SMALL), timeout=60)).cache.hit
            elsewhere = await stub.Generate(ask(fresh, OTHER), timeout=60)
            assert not elsewhere.cache.hit and elsewhere.model == b.model and not first.cache.hit

            # An unknown model is NOT_FOUND, naming it and the models served.
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Generate(ask(question, "gpt-17"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'gpt-17'" in (unknown.value.details() or "")
            assert SMALL in (unknown.value.details() or "") and OTHER in (unknown.value.details() or "")

            listed = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
            assert [(m.name, m.default, m.available) for m in listed.models] == [
                (SMALL, True, True),
                (OTHER, False, True),
            ]
            assert [m.key for m in listed.models] == [a.model, b.model]

            # One model's inference stopped: that model is UNAVAILABLE (its breaker opens), the
            # other keeps answering, uncached.
            await other.stop(grace=0.5)
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError) as down:
                    await stub.Generate(ask("Is anyone there?", OTHER, use_cache=False), timeout=30)
                assert down.value.code() == grpc.StatusCode.UNAVAILABLE
                assert f"inference/{OTHER}" in (down.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as open_:
                await stub.Generate(ask("Is anyone there?", OTHER, use_cache=False), timeout=30)
            assert open_.value.code() == grpc.StatusCode.UNAVAILABLE
            info = unpack_details(status_details(open_.value.trailing_metadata()))
            assert info["error_info"].reason == "CIRCUIT_OPEN"  # type: ignore[attr-defined]
            alive = await stub.Generate(ask("Is anyone there?", SMALL, use_cache=False), timeout=60)
            assert alive.text and alive.model == a.model
            breakers = gw.app.peers.breakers  # type: ignore[attr-defined]
            assert breakers[f"inference/{OTHER}"].state.value == "open"
            assert breakers[f"inference/{SMALL}"].state.value == "closed"
            listed = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
            assert [(m.name, m.available) for m in listed.models] == [(SMALL, True), (OTHER, False)]
            # Each model's in-flight limit is its own, learned from its own tokens.
            window = gw.app.window  # type: ignore[attr-defined]
            assert window.capacity(a.model) is not window.capacity(b.model)


async def test_http_sdk_and_cli_take_a_model(
    models_dir: Path, two_models: tuple[str, str], tmp_path: Path, prefix: str, redis_url: str
) -> None:
    async with two_model_mesh(models_dir, tmp_path, prefix, redis_url) as (tok, _, _, gw):
        # The tokenizer serves each model's tokenizer by name; an unknown one is NOT_FOUND.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tok.port}") as channel:
            tokenizer = tokenizer_pb2_grpc.TokenizerStub(channel)
            named = await tokenizer.Encode(tokenizer_pb2.EncodeRequest(text="hello", model=OTHER), timeout=10)
            default = await tokenizer.Encode(tokenizer_pb2.EncodeRequest(text="hello"), timeout=10)
            assert list(named.ids) == list(default.ids) and named.ids
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await tokenizer.Count(tokenizer_pb2.CountRequest(texts=["x"], model="nope"), timeout=10)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'nope'" in (missing.value.details() or "")

        target = f"127.0.0.1:{gw.port}"
        async with AsyncMesh(target, timeout=60) as mesh:
            assert [m.name for m in await mesh.list_models()] == [SMALL, OTHER]
            via_sdk = await mesh.ask("Say hello.", model=OTHER, use_retrieval=False, max_new_tokens=4)
            assert via_sdk.model.startswith(f"{OTHER}:")
            with pytest.raises(MeshError) as unknown:
                await mesh.ask("Say hello.", model="nope", use_retrieval=False)
            assert unknown.value.code == grpc.StatusCode.NOT_FOUND

        # The HTTP front door lists both and routes by its `model` field.
        http = gw.app.http  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}/v1", timeout=60) as client:
            models = (await client.get("/models")).json()
            assert [m["id"] for m in models["data"]] == [SMALL, OTHER]
            # What each model is served in, as its inference reports it (LLMESH_DTYPE, LLMESH_QUANTIZE).
            assert all(m["llmesh"]["dtype"] in ("float32", "bfloat16") for m in models["data"]), models
            body = {"model": OTHER, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
            body["llmesh"] = {"use_retrieval": False}
            reply = await client.post("/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == OTHER
            assert reply.json()["llmesh"]["model_key"].startswith(f"{OTHER}:")
            missing_http = await client.post("/chat/completions", json={**body, "model": "nope"})
            assert missing_http.status_code == 404

        # The CLI: `llmesh ask --model NAME`.
        def run_cli() -> dict[str, object]:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                argv = ["ask", "Say hello.", "--target", target, "--model", OTHER, "--no-retrieval", "--json"]
                code = cli.main([*argv, "--max-new-tokens", "4"])
            assert code == 0
            return json.loads(out.getvalue())  # type: ignore[no-any-return]

        printed = await asyncio.to_thread(run_cli)
        assert str(printed["model"]).startswith(f"{OTHER}:")


def test_model_settings() -> None:
    """LLMESH_MODELS: name -> target, the default first unless LLMESH_DEFAULT_MODEL says; empty:
    the one unnamed model at LLMESH_INFERENCE_TARGET (the deployment unchanged)."""
    base = {"LLMESH_INFERENCE_TARGET": "10.0.0.1:50053"}
    assert model_routes(load("gateway", base)) == ({"": "10.0.0.1:50053"}, "")
    two = {**base, "LLMESH_MODELS": "small=127.0.0.1:50053, big=dns:///big.llmesh.svc:50053"}
    assert model_routes(load("gateway", two)) == (
        {"small": "127.0.0.1:50053", "big": "dns:///big.llmesh.svc:50053"},
        "small",
    )
    assert model_routes(load("gateway", {**two, "LLMESH_DEFAULT_MODEL": "big"}))[1] == "big"
    with pytest.raises(SettingsError, match="LLMESH_DEFAULT_MODEL='huge' is not one of LLMESH_MODELS"):
        model_routes(load("gateway", {**two, "LLMESH_DEFAULT_MODEL": "huge"}))
    for bad, message in (
        ("small", "must look like name=host:port"),
        ("small=a:1,small=b:2", "listed twice"),
        ("sm all=a:1", "may only hold"),
        ("small=nowhere", "expected host:port"),
    ):
        with pytest.raises(SettingsError, match=message):
            load("gateway", {"LLMESH_MODELS": bad})
    assert load("tokenizer", {"LLMESH_TOKENIZER_MODELS": "a, b"}).tokenizer.models == ("a", "b")
    with pytest.raises(SettingsError, match="listed twice"):
        load("tokenizer", {"LLMESH_TOKENIZER_MODELS": "a,a"})
