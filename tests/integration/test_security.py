"""Mutual TLS between services and API keys at the gateway, on real servers."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.testing import hosted
from llmesh.v1 import gateway_pb2, gateway_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.tokenizer.servicer import TokenizerApp

API_KEY = "test-key-0123456789"
OTHER_KEY = "admin-key-0123456789"


def _creds(certs: Path, client: bool) -> grpc.ChannelCredentials:
    ca = (certs / "client" / "ca.crt").read_bytes()
    if not client:
        return grpc.ssl_channel_credentials(ca)
    key, cert = (certs / "client" / "tls.key").read_bytes(), (certs / "client" / "tls.crt").read_bytes()
    return grpc.ssl_channel_credentials(ca, key, cert)


async def test_mutual_tls_refuses_clients_without_a_certificate(mesh_certs: Path, models_dir: Path) -> None:
    certs = mesh_certs
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_TLS_CERT": str(certs / "tokenizer" / "tls.crt"),
        "LLMESH_TLS_KEY": str(certs / "tokenizer" / "tls.key"),
        "LLMESH_TLS_CLIENT_CA": str(certs / "tokenizer" / "ca.crt"),
    }
    async with hosted("tokenizer", TokenizerApp, env) as host:
        target = f"127.0.0.1:{host.port}"
        request = tokenizer_pb2.CountRequest(texts=["hello world"])
        async with grpc.aio.secure_channel(target, _creds(certs, client=True)) as channel:
            assert list((await tokenizer_pb2_grpc.TokenizerStub(channel).Count(request, timeout=5)).counts) == [2]
        async with grpc.aio.secure_channel(target, _creds(certs, client=False)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as no_cert:
                await tokenizer_pb2_grpc.TokenizerStub(channel).Count(request, timeout=5)
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await tokenizer_pb2_grpc.TokenizerStub(channel).Count(request, timeout=5)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_api_keys_gate_the_gateway_but_not_health() -> None:
    env = {
        "LLMESH_API_KEYS": f"{API_KEY}=acme;{OTHER_KEY}=*",
        # No downstreams: authorization is decided before any of them is called.
        "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
    }
    async with hosted("gateway", GatewayApp, env) as host:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            search = gateway_pb2.SearchRequest(query="anything", tenant="acme")
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.Search(search, timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await stub.Search(search, timeout=5, metadata=[("authorization", "Bearer not-a-key-000000")])
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            other_tenant = gateway_pb2.SearchRequest(query="anything", tenant="globex")
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.Search(other_tenant, timeout=5, metadata=[("authorization", f"Bearer {API_KEY}")])
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # An owned tenant passes authorization and reaches the (absent) retrieval service.
            with pytest.raises(grpc.aio.AioRpcError) as reached:
                await stub.Search(search, timeout=5, metadata=[("authorization", f"Bearer {API_KEY}")])
            assert reached.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as admin_reached:
                await stub.Search(other_tenant, timeout=5, metadata=[("authorization", f"Bearer {OTHER_KEY}")])
            assert admin_reached.value.code() == grpc.StatusCode.UNAVAILABLE
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
