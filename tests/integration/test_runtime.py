"""The shared server runtime on real servers: health, reflection, error mapping, metrics, drain."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmesh.errors import status_details, unpack_details
from llmesh.metrics import MetricsEndpoint
from llmesh.testing import eventually, hosted
from llmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.servicer import TokenizerApp


class ProbeApp:
    """A tokenizer-shaped service whose methods misbehave on purpose, to test the runtime."""

    service_names = ("llmesh.v1.Tokenizer",)

    def __init__(self, settings) -> None:  # type: ignore[no-untyped-def]
        self.warm = asyncio.Event()
        self.release = asyncio.Event()
        self.entered = asyncio.Event()  # a call is in Encode, held until `release`
        self.draining = asyncio.Event()  # the host has begun to stop

    def register(self, server: grpc.aio.Server) -> None:
        app = self

        class Servicer(tokenizer_pb2_grpc.TokenizerServicer):
            async def Encode(self, request, context):  # type: ignore[no-untyped-def]
                app.entered.set()
                await app.release.wait()  # an in-flight call for the drain test
                return tokenizer_pb2.EncodeResponse(ids=[1, 2, 3])

            async def Decode(self, request, context):  # type: ignore[no-untyped-def]
                raise RuntimeError("secret internal detail")

        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Servicer(), server)

    async def start(self) -> None:
        await self.warm.wait()

    async def drain(self, grace: float) -> None:
        # The host runs this beside its gRPC server's stop, which is started first and refuses
        # new calls from its first step on: once this runs, the server is draining.
        self.draining.set()

    async def stop(self) -> None:
        return None


class WarmProbeApp(ProbeApp):
    async def start(self) -> None:
        return None


def _reflected_services(port: int) -> set[str]:
    # The reflection client is blocking: run it off the loop that hosts the server.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


async def _health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return reply.status


async def test_tokenizer_service_serves_health_reflection_and_typed_errors(models_dir: Path) -> None:
    async with hosted("tokenizer", TokenizerApp, {"LLMESH_MODELS_DIR": str(models_dir)}) as host:
        assert await _health(host.port) == health_pb2.HealthCheckResponse.SERVING
        assert await _health(host.port, "llmesh.v1.Tokenizer") == health_pb2.HealthCheckResponse.SERVING
        services = await asyncio.to_thread(_reflected_services, host.port)
        assert {"llmesh.v1.Tokenizer", "grpc.health.v1.Health"} <= services
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            ids = (await stub.Encode(tokenizer_pb2.EncodeRequest(text="The capital of France"))).ids
            assert len(ids) == 4
            text = (await stub.Decode(tokenizer_pb2.DecodeRequest(ids=ids))).text
            assert text == "The capital of France"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Decode(tokenizer_pb2.DecodeRequest(ids=[10**6]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            bad = unpack_details(status_details(info.value.trailing_metadata()))["bad_request"]
            assert bad.field_violations[0].field == "ids"  # type: ignore[attr-defined]


async def test_not_serving_until_warm_then_unknown_errors_are_generic_internal() -> None:
    async with hosted("tokenizer", WarmProbeApp) as host:
        assert await _health(host.port) == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Decode(tokenizer_pb2.DecodeRequest(ids=[1]))
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert info.value.details() == "internal error"
            assert "secret" not in str(info.value.debug_error_string())


async def test_health_watch_streams_status_changes_through_the_runtime_interceptor() -> None:
    """grpc's Health.Watch writes with context.write instead of yielding; the one interceptor must
    pass it through (it failed with "async for requires __aiter__")."""
    async with hosted("tokenizer", WarmProbeApp) as host:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            await host.set_serving(False)
            second = await watch.read()
            assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()


async def test_health_reports_not_serving_during_warm_up() -> None:
    from llmesh.server import ServiceHost
    from llmesh.testing import service_settings

    settings = service_settings("tokenizer")
    app = ProbeApp(settings)
    host = ServiceHost(app, settings)
    starting = asyncio.create_task(host.start())
    await eventually(lambda: host.port, 5.0, message="the host never bound its port")
    assert await _health(host.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    app.warm.set()
    await starting
    assert await _health(host.port) == health_pb2.HealthCheckResponse.SERVING
    await host.stop(grace=1)


async def test_stop_drains_in_flight_calls_and_refuses_new_ones() -> None:
    from llmesh.server import ServiceHost
    from llmesh.testing import service_settings

    settings = service_settings("tokenizer")
    app = ProbeApp(settings)
    app.warm.set()
    host = ServiceHost(app, settings)
    await host.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{host.port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    in_flight = asyncio.ensure_future(stub.Encode(tokenizer_pb2.EncodeRequest(text="x"), timeout=10))
    await asyncio.wait_for(app.entered.wait(), 10)
    stopping = asyncio.create_task(host.stop(grace=5))
    await asyncio.wait_for(app.draining.wait(), 10)
    # The server sends GOAWAY as it stops taking calls; until this channel has it, a new call still
    # goes out on the old connection and is CANCELLED there. Having it, the channel leaves READY.
    if channel.get_state() == grpc.ChannelConnectivity.READY:
        await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 10)
    # The server refuses new RPCs while draining, so read the health state from the servicer itself.
    status = await host.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(tokenizer_pb2.EncodeRequest(text="late"), timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    app.release.set()
    assert list((await in_flight).ids) == [1, 2, 3]
    await stopping
    await channel.close()


async def test_metrics_endpoint_exports_grpc_server_metrics(models_dir: Path) -> None:
    metrics = MetricsEndpoint("127.0.0.1", 0)
    try:
        async with hosted("tokenizer", TokenizerApp, {"LLMESH_MODELS_DIR": str(models_dir)}) as host:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
                await tokenizer_pb2_grpc.TokenizerStub(channel).Count(tokenizer_pb2.CountRequest(texts=["a b"]))
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    finally:
        metrics.close()
    assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="Count",grpc_service="llmesh.v1.Tokenizer"' in body
    assert "grpc_server_handling_seconds_bucket" in body


async def test_unparsable_requests_are_invalid_argument(models_dir: Path) -> None:
    async with hosted("tokenizer", TokenizerApp, {"LLMESH_MODELS_DIR": str(models_dir)}) as host:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            for method in ("/llmesh.v1.Tokenizer/Encode", "/llmesh.v1.Tokenizer/Chunk"):
                call = channel.unary_unary(method)
                for raw in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff", b"\x08\x80"):  # bad UTF-8, corrupt wire
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(raw, timeout=5)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw)


class DependencyProbeApp(WarmProbeApp):
    """Reports a backing store down through health details, as the cache does for Redis."""

    def health_details(self) -> dict[str, bool]:
        return {"redis": False, "qdrant": True}


async def _wait_for_sample(name: str, labels: dict[str, str], value: float, timeout: float = 5.0) -> None:
    from prometheus_client import REGISTRY

    await eventually(
        lambda: REGISTRY.get_sample_value(name, labels) == value,
        timeout,
        message=lambda: f"{name}{labels} is {REGISTRY.get_sample_value(name, labels)}, not {value}",
    )


async def test_health_listener_is_plaintext_and_serves_only_health(mesh_certs: Path) -> None:
    """With mTLS on the service port, LLMESH_HEALTH_LISTEN answers probes without a certificate,
    and serves nothing but health there; llmesh_serving follows the health status."""
    from prometheus_client import REGISTRY

    env = {
        "LLMESH_TLS_CERT": str(mesh_certs / "tokenizer" / "tls.crt"),
        "LLMESH_TLS_KEY": str(mesh_certs / "tokenizer" / "tls.key"),
        "LLMESH_TLS_CLIENT_CA": str(mesh_certs / "tokenizer" / "ca.crt"),
        "LLMESH_HEALTH_LISTEN": "127.0.0.1:0",
    }
    async with hosted("tokenizer", DependencyProbeApp, env) as host:
        assert host.health_port and host.health_port != host.port
        assert await _health(host.health_port) == health_pb2.HealthCheckResponse.SERVING
        assert await _health(host.health_port, "llmesh.v1.Tokenizer") == health_pb2.HealthCheckResponse.SERVING
        assert REGISTRY.get_sample_value("llmesh_serving") == 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.health_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await tokenizer_pb2_grpc.TokenizerStub(channel).Encode(tokenizer_pb2.EncodeRequest(text="x"), timeout=2)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await _health(host.port)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        # Health details become llmesh_dependency_up, which the alerting rules read.
        await _wait_for_sample("llmesh_dependency_up", {"dependency": "redis"}, 0)
        await _wait_for_sample("llmesh_dependency_up", {"dependency": "qdrant"}, 1)
        await host.set_serving(False)
        assert await _health(host.health_port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert REGISTRY.get_sample_value("llmesh_serving") == 0
        await host.set_serving(True)


async def test_invalid_health_listen_address_is_refused() -> None:
    from llmesh.settings import SettingsError
    from llmesh.testing import service_settings

    with pytest.raises(SettingsError, match="LLMESH_HEALTH_LISTEN"):
        service_settings("tokenizer", {"LLMESH_HEALTH_LISTEN": "no-port"})


@pytest.mark.filterwarnings("ignore:Failed to obtain server version")
async def test_qdrant_reachability_follows_the_last_call(tmp_path: Path) -> None:
    from qdrant_client.http.exceptions import ResponseHandlingException

    from llmesh import qdrant
    from llmesh.testing import service_settings

    unreachable = qdrant.open_client(service_settings("cache", {"QDRANT_URL": "http://127.0.0.1:1"}), "cache")
    try:
        assert unreachable.reachable
        with pytest.raises(ResponseHandlingException):
            await unreachable.run(unreachable.client.get_collections)
        assert not unreachable.reachable
    finally:
        unreachable.close()
    local = service_settings("cache", {"LLMESH_DATA_DIR": str(tmp_path), "QDRANT_URL": ""})
    embedded = qdrant.open_client(local, "cache")
    try:
        await embedded.run(embedded.client.get_collections)
        assert embedded.reachable
    finally:
        embedded.close()
