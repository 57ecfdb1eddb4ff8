"""The gateway on real servers (tokenizer, tiny-model inference) with downstreams missing:
degradation, breakers, admission shedding, cancellation and a cluster-wide budget."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.errors import status_details, unpack_details
from llmesh.server import ServiceHost
from llmesh.testing import eventually, hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

CLOSED = "127.0.0.1:1"  # nothing listens there


@contextlib.asynccontextmanager
async def backends(models_dir: Path) -> AsyncIterator[tuple[ServiceHost, ServiceHost]]:
    env = {"LLMESH_MODELS_DIR": str(models_dir), "LLMESH_INFERENCE_MODEL": "tiny"}
    async with hosted("tokenizer", TokenizerApp, env) as tok, hosted("inference", InferenceApp, env) as inf:
        yield tok, inf


def gateway_env(tok: ServiceHost | None, inf: ServiceHost | None, **extra: str) -> dict[str, str]:
    return {
        "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}" if tok else CLOSED,
        "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}" if inf else CLOSED,
        "LLMESH_CACHE_TARGET": CLOSED,
        "LLMESH_RETRIEVAL_TARGET": CLOSED,
        **extra,
    }


async def weight_of(tok: ServiceHost, prompt: str, max_new_tokens: int) -> int:
    """The admission weight the gateway will compute for this prompt (no retrieval context)."""
    from llmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
    from services.gateway.core import build_messages, validate

    plan = validate(ask(prompt, max_new_tokens), gw_config())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tok.port}") as channel:
        rendered = await tokenizer_pb2_grpc.TokenizerStub(channel).ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(messages=build_messages(plan, []), add_generation_prompt=True)
        )
    return rendered.token_count * max_new_tokens


def gw_config():  # type: ignore[no-untyped-def]
    from services.gateway.core import GatewayConfig

    return GatewayConfig("docs", 4, 0.25, 32768, 1536, 512, 128)


def ask(prompt: str, max_new_tokens: int = 8, **kw: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens), **kw
    )


async def test_answers_without_cache_and_retrieval_and_says_so(models_dir: Path, tiny_model: Path) -> None:
    async with backends(models_dir) as (tok, inf), hosted("gateway", GatewayApp, gateway_env(tok, inf)) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            # The missing cache and retrieval must not hold the answer up: it comes within the
            # call's deadline (DEADLINE_EXCEEDED otherwise), not after their own timeouts pile up.
            call = stub.Generate(ask("Hello there"), timeout=10)
            reply = await call
            assert reply.usage.output_tokens == 8 and reply.text
            timing = dict(await call.trailing_metadata())["server-timing"]
            hops = dict(part.split(";dur=") for part in timing.split(", "))
            assert {"cache", "retrieval", "tokenizer", "admission", "inference"} <= set(hops)
            assert all(float(ms) >= 0 for ms in hops.values())
            assert {"cache_unavailable", "retrieval_unavailable"} <= set(reply.degradations)


async def test_tokenizer_down_falls_back_to_a_local_estimate(models_dir: Path, tiny_model: Path) -> None:
    async with backends(models_dir) as (_, inf), hosted("gateway", GatewayApp, gateway_env(None, inf)) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            reply = await gateway_pb2_grpc.GatewayStub(channel).Generate(ask("Hello there"), timeout=30)
    assert "tokenizer_estimate" in reply.degradations
    assert reply.usage.output_tokens == 8


async def test_inference_down_opens_the_breaker_and_fails_fast(models_dir: Path) -> None:
    env = gateway_env(
        None, None, LLMESH_BREAKER_WINDOW="2", LLMESH_BREAKER_MINIMUM_CALLS="2", LLMESH_BREAKER_WAIT_SECONDS="30"
    )
    async with hosted("gateway", GatewayApp, env) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError) as down:
                    await stub.Generate(ask("hi"), timeout=10)
                assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as open_:
                await stub.Generate(ask("hi"), timeout=10)
    # Failing fast: CIRCUIT_OPEN is the breaker's refusal, given without calling inference.
    assert open_.value.code() == grpc.StatusCode.UNAVAILABLE
    info = unpack_details(status_details(open_.value.trailing_metadata()))
    assert info["error_info"].reason == "CIRCUIT_OPEN"  # type: ignore[attr-defined]
    assert "retry_info" in info
    # The model-info lookup is the first call a request makes to inference: its own breaker
    # (cheap calls have theirs) is the one that opened.
    assert gw.app.peers.breakers["inference:info"].state.value == "open"  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def window_filled(models_dir: Path, admitted: int, **extra: str) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    """A gateway whose admission budget holds `admitted` requests for "Hello there" x 16 new
    tokens (and half of one more), with those admitted: the next one is refused."""
    async with backends(models_dir) as (tok, inf):
        weight = await weight_of(tok, "Hello there", 16)
        env = gateway_env(
            tok,
            inf,
            LLMESH_ADMISSION_BUDGET=str(admitted * weight + weight // 2),
            LLMESH_ADMISSION_TENANT_SHARE="1",
            LLMESH_ADMISSION_DEGRADE="false",
            **extra,
        )
        async with hosted("gateway", GatewayApp, env) as gw:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                for _ in range(admitted):
                    reply = await stub.Generate(ask("Hello there", 16), timeout=30)
                    assert reply.usage.input_tokens * 16 == weight
                yield stub


async def test_over_budget_is_shed_at_once_with_retry_info(models_dir: Path, tiny_model: Path) -> None:
    async with window_filled(models_dir, 3) as stub:
        started = time.perf_counter()
        # Shed, not held until budget frees: the refusal comes within the call's deadline, far
        # shorter than the admission window (a held call would end DEADLINE_EXCEEDED).
        with pytest.raises(grpc.aio.AioRpcError) as shed:
            await stub.Generate(ask("Hello there", 16), timeout=5)
        elapsed = time.perf_counter() - started
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = unpack_details(status_details(shed.value.trailing_metadata()))
    delay = details["retry_info"].retry_delay  # type: ignore[attr-defined]
    assert 0 < delay.seconds + delay.nanos / 1e9 <= 10
    assert details["error_info"].reason == "WEIGHT_BUDGET_EXCEEDED"  # type: ignore[attr-defined]
    # The refusal says where the gateway's time went, like a served reply's server-timing (spent
    # within the call the client saw).
    timing = dict(shed.value.trailing_metadata())["server-timing"]
    hops = dict(part.split(";dur=") for part in str(timing).split(", "))
    assert "admission" in hops and float(hops["total"]) < elapsed * 1000


async def test_a_refused_herd_is_told_to_come_back_spread_out(models_dir: Path, tiny_model: Path) -> None:
    # The window is full: every refusal's own advice is the same moment (when the first
    # admitted entries leave). Refused many times per admission, callers are spread over a
    # longer span instead, never past the window, and each message says its own delay (the
    # spread itself, with a fake clock: tests/unit/test_retry_pacing.py).
    advice: list[float] = []
    async with window_filled(models_dir, 2, LLMESH_ADMISSION_WINDOW_SECONDS="20") as stub:
        for _ in range(24):
            with pytest.raises(grpc.aio.AioRpcError) as shed:
                await stub.Generate(ask("Hello there", 16), timeout=30)
            assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            delay = unpack_details(status_details(shed.value.trailing_metadata()))["retry_info"].retry_delay  # type: ignore[attr-defined]
            advice.append(delay.seconds + delay.nanos / 1e9)
            assert f"retry in {advice[-1]:.3f}s" in (shed.value.details() or "")
    # The first refusal: fewer refusals than admissions so far, so its own advice (the time
    # until the first entry leaves: almost the whole window, just admitted).
    exact = advice[0]
    assert 15 < exact <= 20
    assert all(a <= 20 for a in advice)  # never past the window
    # Later ones, many refusals per admission: stretched toward the window (without pacing
    # each is the same moment, a little less as time passes).
    assert sum(a > exact + 0.05 for a in advice[12:]) >= 6


async def test_cancelled_stream_frees_the_inference_slot(models_dir: Path, tiny_model: Path) -> None:
    async with backends(models_dir) as (tok, inf), hosted("gateway", GatewayApp, gateway_env(tok, inf)) as gw:
        engine = inf.app.manager.get().engine  # type: ignore[attr-defined]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            request = ask("Tell me a very long story", 500)
            request.sampling.ignore_eos = True
            call = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(request, timeout=60)
            async for message in call:
                if message.delta:
                    break
            assert engine.running_count == 1
            call.cancel()
            assert await asyncio.to_thread(engine.drain, 10.0)  # the engine's own idle event
            assert engine.running_count == 0


async def test_two_gateways_sharing_redis_enforce_one_budget(
    models_dir: Path, tiny_model: Path, redis_url: str
) -> None:
    async with backends(models_dir) as (tok, inf):
        weight = await weight_of(tok, "Hello there", 16)
        env = gateway_env(
            tok,
            inf,
            LLMESH_ADMISSION_BUDGET=str(3 * weight + weight // 2),
            LLMESH_ADMISSION_TENANT_SHARE="1",
            LLMESH_ADMISSION_DEGRADE="false",
            LLMESH_ADMISSION_REDIS_URL=redis_url,
        )
        async with hosted("gateway", GatewayApp, env) as a, hosted("gateway", GatewayApp, env) as b:
            outcomes = []
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ca,
                grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as cb,
            ):
                stubs = [gateway_pb2_grpc.GatewayStub(ca), gateway_pb2_grpc.GatewayStub(cb)]
                for i in range(4):
                    try:
                        await stubs[i % 2].Generate(ask("Hello there", 16), timeout=30)
                        outcomes.append("ok")
                    except grpc.aio.AioRpcError as err:
                        outcomes.append(err.code().name)
    # Three requests fit a 3.5-request budget whichever gateway takes them; the fourth does not.
    assert outcomes == ["ok", "ok", "ok", "RESOURCE_EXHAUSTED"]


async def test_shared_window_redis_down_is_reported_and_requests_still_admitted(
    models_dir: Path, tiny_model: Path
) -> None:
    """Redis of the shared admission window unreachable: the gateway admits on its local fallback
    and says so in its health details and in llmesh_dependency_up (LlmeshRedisUnreachable)."""
    from prometheus_client import REGISTRY

    async with backends(models_dir) as (tok, inf):
        env = gateway_env(tok, inf, LLMESH_ADMISSION_REDIS_URL="redis://127.0.0.1:1/0")
        async with hosted("gateway", GatewayApp, env) as gw:
            assert gw.app.health_details() == {"redis": True}  # nothing tried yet
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                await gateway_pb2_grpc.GatewayStub(channel).Generate(ask("Hello there", 4), timeout=30)
                assert gw.app.health_details() == {"redis": False}
                health = health_pb2_grpc.HealthStub(channel)
                detail = health_pb2.HealthCheckRequest(service="llmesh.v1.Gateway/redis")

                async def redis_not_serving() -> bool:
                    try:
                        reply = await health.Check(detail, timeout=2)
                    except grpc.aio.AioRpcError as err:  # NOT_FOUND until first published
                        assert err.code() == grpc.StatusCode.NOT_FOUND
                        return False
                    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

                # Published by the runtime's health-details loop (every second).
                await eventually(redis_not_serving, 5.0, message="llmesh.v1.Gateway/redis never became NOT_SERVING")
                # The gauge is set before the health entry in the same pass.
                assert REGISTRY.get_sample_value("llmesh_dependency_up", {"dependency": "redis"}) == 0
                overall = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                assert overall.status == health_pb2.HealthCheckResponse.SERVING


async def test_sigterm_drain_completes_in_flight_streams(models_dir: Path, tiny_model: Path) -> None:
    from llmesh.testing import service_settings

    async with backends(models_dir) as (tok, inf):
        settings = service_settings("gateway", gateway_env(tok, inf))
        gw = ServiceHost(GatewayApp(settings), settings)
        refusing = asyncio.Event()
        drain_http = gw.app.drain  # type: ignore[attr-defined]

        async def drain(grace: float) -> None:
            # The host runs the app's drain beside its gRPC server's stop, which is started
            # first and refuses new calls from its first step on: from here they are refused.
            refusing.set()
            await drain_http(grace)

        gw.app.drain = drain  # type: ignore[attr-defined]
        await gw.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = ask("Tell me a long story", 200)
            request.sampling.ignore_eos = True
            call = stub.GenerateStream(request, timeout=60)
            first = await call.read()
            assert first.delta
            draining = asyncio.create_task(gw.stop(grace=20))
            # Health.Watch does not pass the runtime interceptor, so the app's drain is the event.
            await asyncio.wait_for(refusing.wait(), 10)
            # The server sends GOAWAY as it stops taking calls; until this channel has it, a new
            # call still goes out on the old connection and is CANCELLED there, not refused.
            if channel.get_state() == grpc.ChannelConnectivity.READY:
                await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(ask("new work"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = []
            while (message := await call.read()) is not grpc.aio.EOF:
                rest.append(message)
            await draining
    assert rest[-1].HasField("final")
    assert rest[-1].final.usage.output_tokens == 200
    assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
