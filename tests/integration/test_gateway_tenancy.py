"""llmesh as a shared service, on real servers (tokenizer, two tiny-model inference services, the
cache on the run's Redis, the gateway's shared window and key limits on Redis too): keys from a
file that change without a restart, per-key limits on both APIs, usage per tenant that adds up
to what the responses said, and an alias that falls back while its first model is down."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from llmesh import keys_file
from llmesh.errors import status_details, unpack_details
from llmesh.server import ServiceHost
from llmesh.testing import build_tiny_model, eventually, hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

FIRST, SECOND = "tiny", "tiny-seed1"


@pytest.fixture(scope="module")
def two_models(models_dir: Path) -> tuple[str, str]:
    build_tiny_model(models_dir, name=FIRST, seed=0)
    build_tiny_model(models_dir, name=SECOND, seed=1)
    return FIRST, SECOND


@pytest.fixture(scope="module")
async def mesh(
    models_dir: Path, two_models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[dict[str, Any]]:
    """Tokenizer, cache and the second model's inference for the module; the first model's
    inference is started per test (`first_inference`), so a test may stop it."""
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("tenancy-data")),
        "LLMESH_REDIS_URL": module_redis_url,
        "QDRANT_URL": "",
        "LLMESH_TOKENIZER_MODELS": f"{FIRST},{SECOND}",
    }
    async with (
        hosted("tokenizer", TokenizerApp, env) as tok,
        hosted("inference", InferenceApp, {**env, "LLMESH_INFERENCE_MODEL": SECOND}) as second,
        hosted("cache", lambda s: CacheApp(s, semantic=False), env) as cache,
    ):
        yield {
            "env": env,
            "second": second,
            "targets": {
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": "127.0.0.1:1",  # LLMESH_MODELS names the models
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
            },
        }


def first_inference(mesh: dict[str, Any], port: int = 0) -> contextlib.AbstractAsyncContextManager[ServiceHost]:
    env = {**mesh["env"], "LLMESH_INFERENCE_MODEL": FIRST, "LLMESH_LISTEN": f"127.0.0.1:{port}"}
    return hosted("inference", InferenceApp, env)


@contextlib.asynccontextmanager
async def gateway(mesh: dict[str, Any], first: ServiceHost, redis_url: str, **extra: str) -> AsyncIterator[ServiceHost]:
    env = {
        **mesh["env"],
        **mesh["targets"],
        "LLMESH_MODELS": f"{FIRST}=127.0.0.1:{first.port},{SECOND}=127.0.0.1:{mesh['second'].port}",
        "LLMESH_ADMISSION_REDIS_URL": redis_url,  # the shared window, and the key limits with it
        "LLMESH_BREAKER_WINDOW": "2",
        "LLMESH_BREAKER_MINIMUM_CALLS": "2",
        "LLMESH_BREAKER_WAIT_SECONDS": "30",
        **extra,
    }
    async with hosted("gateway", GatewayApp, env) as gw:
        yield gw


@contextlib.asynccontextmanager
async def grpc_stub(gw: ServiceHost) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def ask(prompt: str, model: str = "", *, tokens: int = 4, use_cache: bool = True, tenant: str = "acme") -> Any:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        model=model,
        tenant=tenant,
        use_retrieval=False,
        use_cache=use_cache,
        sampling=common_pb2.SamplingParams(max_new_tokens=tokens),
    )


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def http_base(gw: ServiceHost) -> str:
    return f"http://127.0.0.1:{gw.app.http.port}/v1"  # type: ignore[attr-defined]


def chat(model: str, prompt: str, **llmesh: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "llmesh": {"use_retrieval": False, **llmesh},
    }


async def test_a_key_past_its_rpm_limit_is_refused_on_both_apis_and_its_neighbour_is_not(
    mesh: dict[str, Any], tmp_path: Path, redis_url: str
) -> None:
    path = tmp_path / "keys.json"
    limited, limited_key = keys_file.create(path, "acme", rpm=2, name="limited")
    _, neighbour = keys_file.create(path, "acme", name="neighbour")
    _, http_limited = keys_file.create(path, "acme", rpm=2)
    _, second_only = keys_file.create(path, "acme", models=(SECOND,))
    async with first_inference(mesh) as first, gateway(mesh, first, redis_url, LLMESH_API_KEYS_FILE=str(path)) as gw:
        async with grpc_stub(gw) as stub:
            for i in range(2):
                await stub.Generate(ask(f"hello {i}", FIRST), metadata=bearer(limited_key), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(ask("hello 2", FIRST), metadata=bearer(limited_key), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 requests per minute" in (refused.value.details() or "")
            info = unpack_details(status_details(refused.value.trailing_metadata()))
            assert info["error_info"].reason == "KEY_RPM_EXCEEDED"  # type: ignore[attr-defined]
            assert info["error_info"].metadata["key_id"] == limited.id  # type: ignore[attr-defined]
            delay = info["retry_info"].retry_delay  # type: ignore[attr-defined]
            assert 0 < delay.seconds + delay.nanos / 1e9 <= 60
            # A key that names its models may use those only.
            with pytest.raises(grpc.aio.AioRpcError) as not_allowed:
                await stub.Generate(ask("hello", FIRST), metadata=bearer(second_only), timeout=60)
            assert not_allowed.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (await stub.Generate(ask("hello", SECOND), metadata=bearer(second_only), timeout=60)).text
            # Another key of the same tenant is not limited by it.
            for i in range(4):
                reply = await stub.Generate(ask(f"hello {i}", FIRST), metadata=bearer(neighbour), timeout=60)
                assert reply.text
        async with httpx.AsyncClient(base_url=http_base(gw), timeout=60) as http:
            headers = {"authorization": f"Bearer {http_limited}"}
            for i in range(2):
                ok = await http.post("/chat/completions", json=chat(FIRST, f"hi {i}"), headers=headers)
                assert ok.status_code == 200, ok.text
            over = await http.post("/chat/completions", json=chat(FIRST, "hi 2"), headers=headers)
            assert over.status_code == 429
            assert 1 <= int(over.headers["retry-after"]) <= 60
            error = over.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "key_rpm_exceeded"
            fine = await http.post(
                "/chat/completions", json=chat(FIRST, "hi 2"), headers={"authorization": f"Bearer {neighbour}"}
            )
            assert fine.status_code == 200
        # The limit is the cluster's: a second gateway on the same Redis sees the same key as full.
        async with gateway(mesh, first, redis_url, LLMESH_API_KEYS_FILE=str(path)) as other:
            async with grpc_stub(other) as stub:
                with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                    await stub.Generate(ask("hello again", FIRST), metadata=bearer(limited_key), timeout=60)
            assert elsewhere.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _sample("llmesh_gateway_tenant_key_limited_total", tenant="acme", model=FIRST, limit="rpm") >= 3


async def test_a_key_added_to_or_revoked_from_the_file_works_from_the_next_reread_without_a_restart(
    mesh: dict[str, Any], tmp_path: Path, redis_url: str
) -> None:
    path = tmp_path / "keys.json"
    _, old = keys_file.create(path, "acme")
    env_key = "env-key-for-the-acme-tenant-01"
    async with (
        first_inference(mesh) as first,
        gateway(mesh, first, redis_url, LLMESH_API_KEYS_FILE=str(path), LLMESH_API_KEYS=f"{env_key}=acme") as gw,
    ):
        async with grpc_stub(gw) as stub:

            async def works(key: str) -> bool:
                try:
                    await stub.Generate(ask("Are you there?", FIRST), metadata=bearer(key), timeout=30)
                    return True
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                    return False

            async def reread(result: str, change: Callable[[], Any]) -> Any:
                """Makes the change (its value returned), then waits for the gateway's watcher (a
                stat every 0.5 s) to re-read the file: the reload counter moves once the keys the
                file holds are in force."""
                before = _sample("llmesh_gateway_api_keys_reloads_total", result=result)
                changed = change()
                await eventually(
                    lambda: _sample("llmesh_gateway_api_keys_reloads_total", result=result) > before,
                    10.0,
                    message=f"the gateway never re-read the file ({result})",
                )
                return changed

            assert await works(old) and await works(env_key)
            # As `llmesh keys create` and `llmesh keys revoke` change it:
            record, new = await reread("ok", lambda: keys_file.create(path, "acme", name="added"))
            assert await works(new)
            await reread("ok", lambda: keys_file.revoke(path, record.id))
            assert not await works(new)
            assert await works(old) and await works(env_key)  # the others untouched
            # A broken file keeps the keys in force: never an open (or closed) gateway.
            await reread("error", lambda: path.write_text("{not json"))
            assert await works(old)
            assert not await works(new)
            assert not await works("no-such-key-000000000000")


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_an_alias_falls_back_while_its_first_model_is_stopped_and_returns_after(
    mesh: dict[str, Any], redis_url: str
) -> None:
    aliases = {"LLMESH_MODEL_ALIASES": f"assistant={FIRST},{SECOND}"}
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(first_inference(mesh))
        gw = await stack.enter_async_context(gateway(mesh, first, redis_url, **aliases))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        stub = await stack.enter_async_context(grpc_stub(gw))
        usual = await stub.Generate(ask("Who answers?", "assistant", use_cache=False), timeout=60)
        assert usual.answered_by == FIRST and "model_fallback" not in usual.degradations
        assert usual.model.startswith(f"{FIRST}:")
        listed = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
        alias = next(m for m in listed.models if m.name == "assistant")
        assert list(alias.alias_of) == [FIRST, SECOND] and alias.available

        await first.stop(grace=0.5)
        for i in range(4):  # failing calls, then an open breaker: the second model serves
            reply = await stub.Generate(ask(f"Who answers now? {i}", "assistant"), timeout=60)
            assert reply.answered_by == SECOND, reply
            assert "model_fallback" in reply.degradations and reply.model.startswith(f"{SECOND}:")
        body = await http.post(f"{http_base(gw)}/chat/completions", json=chat("assistant", "And on HTTP?"))
        assert body.status_code == 200, body.text
        assert body.json()["model"] == SECOND
        assert "model_fallback" in body.json()["llmesh"]["degradations"]
        await gw.app.gateway.settle()  # type: ignore[attr-defined]

        await stack.enter_async_context(first_inference(mesh, first.port))  # back, on the same address

        async def first_answers() -> gateway_pb2.GenerateResponse | None:
            reply = await stub.Generate(ask("Who answers now? 0", "assistant"), timeout=60)
            return reply if reply.answered_by == FIRST else None

        # The breaker's health probe half-opens it within a probe interval.
        reply = await eventually(first_answers, 15.0, interval=0.1, message="the first model never served again")
        # The cache keys on the model that answered: the second model's cached answer to this
        # question did not serve as the first model's.
        assert not reply.cache.hit and "model_fallback" not in reply.degradations
        assert (await stub.Generate(ask("Something new", "assistant"), timeout=60)).answered_by == FIRST


async def test_tenant_token_counters_match_the_responses_usage_after_a_mixed_run(
    mesh: dict[str, Any], tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.json"
    keys = {tenant: keys_file.create(path, tenant, tpm=10_000_000)[1] for tenant in ("usage-a", "usage-b")}
    counters = {
        "in": "llmesh_gateway_tenant_input_tokens_total",
        "out": "llmesh_gateway_tenant_output_tokens_total",
        "saved": "llmesh_gateway_tenant_saved_tokens_total",
        "requests": "llmesh_gateway_tenant_requests_total",
    }

    def totals(tenant: str) -> dict[str, float]:
        return {k: sum(_sample(name, tenant=tenant, model=m) for m in (FIRST, SECOND)) for k, name in counters.items()}

    before = {t: totals(t) for t in keys}
    seen = {t: {"in": 0, "out": 0, "saved": 0, "requests": 0} for t in keys}
    hits = 0
    caplog.set_level(logging.INFO, logger="llmesh.gateway")
    async with (
        first_inference(mesh) as first,
        gateway(mesh, first, redis_url, LLMESH_API_KEYS_FILE=str(path)) as gw,
        httpx.AsyncClient(base_url=http_base(gw), timeout=60) as http,
    ):
        async with grpc_stub(gw) as stub:
            for round_ in range(2):  # the second round: exact cache hits of the first
                for tenant, key in keys.items():
                    for i, model in enumerate((FIRST, SECOND)):
                        reply = await stub.Generate(
                            ask(f"{tenant} asks question {i}", model, tokens=6, tenant=tenant),
                            metadata=bearer(key),
                            timeout=60,
                        )
                        u = reply.usage
                        if reply.cache.hit:
                            hits += 1
                            assert u.input_tokens == 0 and u.output_tokens == 0  # nothing spent again
                            assert u.cached_input_tokens > 0 and u.cached_output_tokens > 0
                        seen[tenant]["in"] += u.input_tokens
                        seen[tenant]["out"] += u.output_tokens
                        seen[tenant]["saved"] += u.cached_input_tokens + u.cached_output_tokens
                        seen[tenant]["requests"] += 1
                        # The same over HTTP, streamed on the second round, with usage asked for.
                        body = chat(model, f"{tenant} asks on HTTP {i}")
                        headers = {"authorization": f"Bearer {key}"}
                        if round_:
                            body |= {"stream": True, "stream_options": {"include_usage": True}}
                            usage, extension = await _streamed_usage(http, body, headers)
                        else:
                            answer = await http.post("/chat/completions", json=body, headers=headers)
                            assert answer.status_code == 200, answer.text
                            usage, extension = answer.json()["usage"], answer.json()["llmesh"]["usage"]
                        cached = usage["prompt_tokens_details"]["cached_tokens"]
                        if round_:  # a cached answer: no token generated, what it saved reported
                            assert cached > 0 and usage["completion_tokens"] == 0
                            assert extension["input_tokens"] == 0 and extension["saved_tokens"] > cached
                        # A fresh answer's cached tokens are the engine's prefix-cache hits: input
                        # it reused, but processed and billed all the same; a cached answer's are
                        # the answer cache's, never processed.
                        from_answer_cache = cached if round_ else 0
                        assert usage["prompt_tokens"] - from_answer_cache == extension["input_tokens"]
                        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
                        seen[tenant]["in"] += usage["prompt_tokens"] - from_answer_cache
                        seen[tenant]["out"] += usage["completion_tokens"]
                        seen[tenant]["saved"] += extension["saved_tokens"]
                        seen[tenant]["requests"] += 1
                await gw.app.gateway.settle()  # type: ignore[attr-defined]
    assert hits == 4
    for tenant in keys:
        after = totals(tenant)
        assert {k: after[k] - before[tenant][k] for k in counters} == seen[tenant], tenant
        assert seen[tenant]["saved"] > 0 and seen[tenant]["out"] > 0
    lines = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "generate"]
    assert len(lines) == sum(s["requests"] for s in seen.values())
    fields = lines[-1].fields  # type: ignore[attr-defined]
    assert fields["tenant"] == "usage-b" and fields["key_id"].startswith("k") and fields["status"] == "OK"
    assert {"model", "cache_tier", "input_tokens", "output_tokens", "degradations", "duration_ms"} <= set(fields)
    assert not any(key in caplog.text for key in keys.values())  # key ids, never keys


async def _streamed_usage(
    http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The usage chunk of a streamed answer, and the llmesh extension's usage of its last chunk."""
    import json

    usage: dict[str, Any] = {}
    extension: dict[str, Any] = {}
    async with http.stream("POST", "/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                extension = chunk.get("llmesh", {}).get("usage", extension)
    assert usage and extension, "no usage in the stream"
    return usage, extension


async def test_a_stream_cancelled_midway_is_billed_what_it_generated(mesh: dict[str, Any], redis_url: str) -> None:
    tenant = "usage-cancel"
    out = ("llmesh_gateway_tenant_output_tokens_total", {"tenant": tenant, "model": FIRST})
    before_in = _sample("llmesh_gateway_tenant_input_tokens_total", tenant=tenant, model=FIRST)
    before_out = _sample(out[0], **out[1])
    async with first_inference(mesh) as first, gateway(mesh, first, redis_url) as gw, grpc_stub(gw) as stub:
        request = ask("Tell me a very long story", FIRST, tokens=400, use_cache=False, tenant=tenant)
        request.sampling.ignore_eos = True
        call = stub.GenerateStream(request, timeout=60)
        deltas = 0
        async for message in call:
            deltas += bool(message.delta)
            if deltas == 3:
                break
        call.cancel()
        await eventually(  # counted when the gateway's pipeline ends
            lambda: _sample(out[0], **out[1]) != before_out,
            10.0,
            message="a cancelled stream's tokens were never counted",
        )
    assert _sample("llmesh_gateway_tenant_input_tokens_total", tenant=tenant, model=FIRST) > before_in
    assert 3 <= _sample(out[0], **out[1]) - before_out < 400
