"""The client SDK (sync and async) against a real in-process mesh: every call, its typed
errors, API keys and TLS."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmesh.client import AsyncMesh, AuthError, InvalidRequestError, Mesh, OverloadedError, UnavailableError
from llmesh.server import ServiceHost
from llmesh.testing import hosted
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.retrieval.servicer import RetrievalApp
from services.tokenizer.servicer import TokenizerApp

API_KEY = "sdk-test-key-0123456789"


@contextlib.asynccontextmanager
async def mesh(models_dir: Path, data_dir: Path, redis_url: str, **gateway_env: str) -> AsyncIterator[ServiceHost]:
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(data_dir),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": redis_url,
        "QDRANT_URL": "",
        **{k: v for k, v in gateway_env.items() if k.startswith("LLMESH_TLS")},
    }
    async with hosted("tokenizer", TokenizerApp, env) as tok, hosted("inference", InferenceApp, env) as inf:
        peer = {"LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}"}
        async with hosted("cache", CacheApp, env) as cache, hosted("retrieval", RetrievalApp, {**env, **peer}) as ret:
            targets = {
                **peer,
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": f"127.0.0.1:{ret.port}",
            }
            async with hosted("gateway", GatewayApp, {**env, **targets, **gateway_env}) as gw:
                yield gw


async def test_every_call_sync_and_async(models_dir: Path, tiny_model: Path, tmp_path: Path, redis_url: str) -> None:
    async with mesh(models_dir, tmp_path, redis_url, LLMESH_API_KEYS=f"{API_KEY}=acme") as gw:
        target = f"127.0.0.1:{gw.port}"
        async with AsyncMesh(target, api_key=API_KEY) as client:
            ingested = await client.ingest([("doc-1", "The Vellmora lighthouse is purple.")], tenant="acme")
            assert ingested.documents == 1 and ingested.chunks == 1
            found = await client.search("purple lighthouse", tenant="acme")
            assert found.results[0].document_id == "doc-1"
            answer = await client.ask("What color is the lighthouse?", tenant="acme", max_new_tokens=8)
            assert answer.usage.output_tokens == 8 and [s.document_id for s in answer.sources] == ["doc-1"]
            await gw.app.gateway.settle()  # type: ignore[attr-defined]  # the store runs after the answer
            again = await client.ask("What color is the lighthouse?", tenant="acme", max_new_tokens=8)
            assert again.cache.hit and again.text == answer.text
            parts = [m async for m in client.stream("Say something", tenant="acme", max_new_tokens=8)]
            assert parts[-1].HasField("final") and "".join(m.delta for m in parts[:-1]) == parts[-1].final.text
            two = await client.ask(
                "Say two things", tenant="acme", max_new_tokens=4, n=2, logprobs=True, top_logprobs=2
            )
            assert len(two.choices) == 2 and all(len(c.logprobs) == 4 for c in two.choices)
            vectors = await client.embed(["purple lighthouse", "a violet beacon"], tenant="acme")
            assert len(vectors) == 2 and len(vectors[0]) == 384
            # A key that owns one tenant acts for it when the request names none (as on HTTP):
            # written, searched and answered in acme's scope, not refused as "default".
            await client.ingest([("doc-3", "The Orvanto bridge is green.")])
            found = await client.search("green bridge", tenant="acme")
            assert "doc-3" in [r.document_id for r in found.results]
            unnamed = await client.ask("What color is the bridge?", max_new_tokens=4)
            assert "doc-3" in [s.document_id for s in unnamed.sources]

        def sync_calls() -> None:
            with Mesh(target, api_key=API_KEY) as client:
                assert client.search("lighthouse", tenant="acme").results
                reply = client.ask("Say something else", tenant="acme", max_new_tokens=4)
                assert reply.usage.output_tokens == 4
                streamed = list(client.stream("Say something else", tenant="acme", max_new_tokens=4, use_cache=False))
                assert streamed[-1].final.usage.output_tokens == 4
                assert client.ingest([("doc-2", "More text.")], tenant="acme").documents == 1
                embedded = client.embed_response(["one text"], tenant="acme")
                assert embedded.model == "all-MiniLM-L6-v2" and embedded.usage.input_tokens == 4
                with pytest.raises(InvalidRequestError) as bad_input:
                    client.embed(["fine", ""], tenant="acme")
                assert [f for f, _ in bad_input.value.field_violations] == ["inputs[1]"]
                with pytest.raises(InvalidRequestError) as bad:
                    client.ask("", tenant="acme", top_p=3.0)
                assert {f for f, _ in bad.value.field_violations} == {"prompt", "sampling.top_p"}
                with pytest.raises(AuthError):
                    client.ask("hello", tenant="globex")
            with Mesh(target) as anonymous, pytest.raises(AuthError) as no_key:
                anonymous.search("lighthouse", tenant="acme")
            assert no_key.value.reason == "API_KEY_MISSING"

        await asyncio.to_thread(sync_calls)


async def test_overload_and_unavailable_are_typed(
    models_dir: Path, tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    async with mesh(
        models_dir,
        tmp_path,
        redis_url,
        LLMESH_ADMISSION_BUDGET="10",
        LLMESH_ADMISSION_DEGRADE="false",
        LLMESH_ADMISSION_TENANT_SHARE="1",
    ) as gw:
        async with AsyncMesh(f"127.0.0.1:{gw.port}") as client:
            with pytest.raises(InvalidRequestError):  # heavier than the whole budget: can never fit
                await client.ask("hello there", max_new_tokens=64)
    async with AsyncMesh("127.0.0.1:1", timeout=2) as nowhere:
        with pytest.raises(UnavailableError):
            await nowhere.search("anything")


async def test_overloaded_error_carries_retry_after(
    models_dir: Path, tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    async with mesh(
        models_dir,
        tmp_path,
        redis_url,
        LLMESH_ADMISSION_BUDGET="400",
        LLMESH_ADMISSION_DEGRADE="false",
        LLMESH_ADMISSION_TENANT_SHARE="1",
    ) as gw:
        # The error itself, as the mesh sent it: no retries, no client-side throttling.
        async with AsyncMesh(f"127.0.0.1:{gw.port}", retries=0, throttle=False) as client:
            with pytest.raises(OverloadedError) as overloaded:
                for i in range(20):
                    await client.ask(f"hello {i}", max_new_tokens=4, use_cache=False)
    assert overloaded.value.retry_after is not None and 0 < overloaded.value.retry_after <= 10
    assert overloaded.value.reason == "WEIGHT_BUDGET_EXCEEDED"


async def test_tls_with_client_certificate(
    models_dir: Path, tiny_model: Path, tmp_path: Path, mesh_certs: Path, redis_url: str
) -> None:
    certs = mesh_certs
    # One certificate for every in-process service here (the compose stack gives each its own).
    tls = {
        "LLMESH_TLS_CERT": str(certs / "cache" / "tls.crt"),
        "LLMESH_TLS_KEY": str(certs / "cache" / "tls.key"),
        "LLMESH_TLS_CLIENT_CA": str(certs / "cache" / "ca.crt"),
        "LLMESH_TLS_CA": str(certs / "cache" / "ca.crt"),
    }
    ca = str(certs / "client" / "ca.crt")
    async with mesh(models_dir, tmp_path / "data", redis_url, **tls) as gw:
        target = f"127.0.0.1:{gw.port}"
        async with AsyncMesh(
            target,
            ca_file=ca,
            cert_file=str(certs / "client" / "tls.crt"),
            key_file=str(certs / "client" / "tls.key"),
        ) as client:
            ingested = await client.ingest([("tls-doc", "Documents travel over mutual TLS too.")])
            assert ingested.chunks == 1  # retrieval reached the tokenizer over mutual TLS
            reply = await client.ask("Hello over mutual TLS", max_new_tokens=4)
            # Every hop behind the gateway is mutual TLS too: the answer needed all of them.
            assert reply.usage.output_tokens == 4 and not reply.degradations
        async with AsyncMesh(target, ca_file=ca, timeout=5) as no_cert:
            with pytest.raises(UnavailableError):
                await no_cert.ask("no client certificate", max_new_tokens=4)
