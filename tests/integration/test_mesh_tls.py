"""Mutual TLS by default, on the mesh started the way docker-compose.yml starts it: five
processes, each with its compose environment (TLS files, client CA, health listener and the
rest), certificates from scripts/mesh-certs.sh (the script the compose `certs` job runs) and the
gateway's keys from scripts/mesh-keys.sh (the `keys` job's). Every internal port refuses a
client without a mesh certificate; the gateway serves one that holds an API key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh import settings
from llmesh.client import Mesh as Client
from llmesh.client import MeshError
from llmesh.supervisor import Mesh
from llmesh.testing import REPO_ROOT, build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COMPOSE = REPO_ROOT / "docker-compose.yml"
CERTS_MOUNT = "/certs"
KEYS_MOUNT = "/keys"
INTERNAL = tuple(s for s in settings.SERVICES if s != "gateway")
# The compose file's two models, as tiny models here: the supervisor runs one inference process
# per model (`inference/NAME`) with the environment of the compose service serving it.
MODELS = {"tiny": "inference", "tiny-seed1": "inference-assistant"}
# Each process of the mesh and the compose service (the name peers dial, in its certificate) it is.
INTERNAL_PROCESSES = {
    **{name: name for name in INTERNAL if name != "inference"},
    **{f"inference/{model}": service for model, service in MODELS.items()},
}
# What differs between containers and processes on one host: addresses and ports (the
# supervisor binds port 0 and sets the peer targets), the data folder, the backing stores, the
# trace collector. The inference model is the tiny one to keep the test fast.
HOST_SPECIFIC = {
    "LLMESH_LISTEN",
    "LLMESH_METRICS_PORT",
    "LLMESH_METRICS_HOST",
    "LLMESH_DATA_DIR",
    "LLMESH_REDIS_URL",
    "LLMESH_INFERENCE_MODEL",
    # Which models and where: the tiny models here, on the supervisor's ports.
    "LLMESH_MODELS",
    "LLMESH_DEFAULT_MODEL",
    "LLMESH_TOKENIZER_MODELS",
    "QDRANT_URL",
    "QDRANT_API_KEY",
}


COMPOSE_DEFAULT = re.compile(r"\$\{\w+:-([^}]*)\}")


def compose_environment(name: str, certs: Path, keys: Path | None = None) -> dict[str, str]:
    """The service's environment in docker-compose.yml, with the certificate volume mapped to
    `certs` (the keys volume to `keys`) and the host-specific variables left to the supervisor and
    the test."""
    service: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"][name]
    env = {str(k): str(v) for k, v in service["environment"].items()}
    kept: dict[str, str] = {}
    for key, raw in env.items():
        # Compose interpolates ${NAME:-default}; the stack started as shipped gets the defaults.
        value = COMPOSE_DEFAULT.sub(lambda m: m.group(1), raw)
        if key in HOST_SPECIFIC or key.endswith("_TARGET") or key.startswith(("OTEL_", "HF_")):
            continue
        if value.startswith(CERTS_MOUNT + "/"):
            value = str(certs / value.removeprefix(CERTS_MOUNT + "/"))
        if value.startswith(KEYS_MOUNT + "/"):
            assert keys is not None, f"{name} reads the keys volume"
            value = str(keys / value.removeprefix(KEYS_MOUNT + "/"))
        if key == "LLMESH_HEALTH_LISTEN":
            # Each container has its own loopback; five processes on one host need five ports.
            value = value.rpartition(":")[0] + ":0"
        kept[key] = value
    return kept


@pytest.fixture(scope="module")
def foreign_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates from another CA: valid-looking, but not the mesh's."""
    out = tmp_path_factory.mktemp("foreign") / "mesh"
    subprocess.run([str(REPO_ROOT / "scripts" / "mesh-certs.sh"), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def mesh_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The keys volume as the compose `keys` job fills it, and the API key it printed."""
    out = tmp_path_factory.mktemp("keys") / "keys"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    job = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "mesh-keys.sh"), str(out)], capture_output=True, text=True, env=env
    )
    assert job.returncode == 0, job.stderr
    key = re.search(r"API key .*: (\S+)$", job.stdout, re.MULTILINE)
    assert key, job.stdout
    return out, key.group(1)


@pytest.fixture(scope="module")
def mesh(
    models_dir: Path,
    tiny_model: Path,
    mesh_certs: Path,
    mesh_keys: tuple[Path, str],
    tmp_path_factory: pytest.TempPathFactory,
    module_redis_url: str,
) -> Iterator[Mesh]:
    build_tiny_model(models_dir, name="tiny-seed1", seed=1)
    keys = mesh_keys[0]
    service_env = {name: compose_environment(name, mesh_certs, keys) for name in settings.SERVICES}
    # The gateway's entrypoint reads the admin key file into LLMESH_ADMIN_KEYS.
    service_env["gateway"]["LLMESH_ADMIN_KEYS"] = (keys / "admin-key").read_text().strip()
    service_env |= {f"inference/{model}": compose_environment(svc, mesh_certs) for model, svc in MODELS.items()}
    for name, env in service_env.items():
        # The compose stack runs every service with TLS on, and the internal ones require client certs.
        assert Path(env["LLMESH_TLS_CERT"]).is_file() and Path(env["LLMESH_TLS_KEY"]).is_file(), name
        assert Path(env["LLMESH_TLS_CA"]).is_file(), name
        assert ("LLMESH_TLS_CLIENT_CA" in env) == (name in INTERNAL or name in INTERNAL_PROCESSES), name
    base = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("mesh-tls-data")),
        "LLMESH_MODELS": ",".join(f"{model}=127.0.0.1:0" for model in MODELS),
        "LLMESH_REDIS_URL": module_redis_url,
        "QDRANT_URL": "",
    }
    with Mesh(env=base, service_env=service_env) as procs:
        yield procs


def credentials(certs: Path, identity: str | None) -> grpc.ChannelCredentials:
    ca = (certs / "client" / "ca.crt").read_bytes()
    if identity is None:
        return grpc.ssl_channel_credentials(ca)
    key, cert = (certs / identity / "tls.key").read_bytes(), (certs / identity / "tls.crt").read_bytes()
    return grpc.ssl_channel_credentials(ca, key, cert)


def health(
    target: str, creds: grpc.ChannelCredentials | None, server_name: str | None = None
) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def refused(target: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        health(target, creds)
    return info.value.code()  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("process", INTERNAL_PROCESSES)
def test_internal_port_refuses_clients_without_a_mesh_certificate(
    mesh: Mesh, mesh_certs: Path, foreign_certs: Path, process: str
) -> None:
    target, name = mesh.target(process), INTERNAL_PROCESSES[process]
    serving = health_pb2.HealthCheckResponse.SERVING
    # Control: with a mesh certificate the port answers, also under the names peers dial it by
    # (compose service name, Kubernetes Service name): the certificate covers them.
    for server_name in (None, name, f"{name}.llmesh.svc.cluster.local"):
        assert health(target, credentials(mesh_certs, "client"), server_name) == serving, server_name
    assert refused(target, None) == grpc.StatusCode.UNAVAILABLE, "plaintext accepted"
    assert refused(target, credentials(mesh_certs, None)) == grpc.StatusCode.UNAVAILABLE, "no client cert accepted"
    foreign = grpc.ssl_channel_credentials(
        (mesh_certs / "client" / "ca.crt").read_bytes(),
        (foreign_certs / "client" / "tls.key").read_bytes(),
        (foreign_certs / "client" / "tls.crt").read_bytes(),
    )
    assert refused(target, foreign) == grpc.StatusCode.UNAVAILABLE, "a certificate from another CA accepted"


def test_gateway_serves_callers_without_a_client_certificate(
    mesh: Mesh, mesh_certs: Path, mesh_keys: tuple[Path, str]
) -> None:
    target = mesh.target("gateway")
    ca = str(mesh_certs / "client" / "ca.crt")
    # API keys are on: a caller without one is refused before any hop.
    with Client(target, ca_file=ca, timeout=30, retries=0) as anonymous, pytest.raises(MeshError) as refusal:
        anonymous.ask("Hello over TLS", max_new_tokens=4)
    assert refusal.value.code == grpc.StatusCode.UNAUTHENTICATED, refusal.value
    with Client(target, ca_file=ca, api_key=mesh_keys[1], timeout=120) as client:
        # Ingest: gateway -> retrieval -> tokenizer, each hop over mutual TLS.
        assert client.ingest([("tls-doc", "The mesh speaks mutual TLS between its services.")]).chunks == 1
        # Generation: gateway -> cache, retrieval, tokenizer, inference, each over mutual TLS.
        for model in MODELS:  # each model's inference over mutual TLS, with its own certificate
            reply = client.ask("Hello over TLS", max_new_tokens=4, model=model)
            assert reply.usage.output_tokens == 4 and reply.model.startswith(f"{model}:")
            assert not reply.degradations, reply.degradations  # no hop was left out
    # The gateway speaks TLS only: a plaintext caller is refused.
    assert refused(target, None) == grpc.StatusCode.UNAVAILABLE


def test_compose_health_checks_pass_without_a_certificate(mesh: Mesh) -> None:
    """The compose health check (its exact command) reads each service's plaintext health-only
    listener: healthy while the service port requires mTLS."""
    check = yaml.safe_load(COMPOSE.read_text())["x-llmesh-healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    assert set(mesh.procs) == {"gateway", *INTERNAL_PROCESSES}
    for name in mesh.procs:
        health_port = mesh.procs[name].health_port
        assert health_port, f"{name} has no health listener"
        env = {"LLMESH_HEALTH_LISTEN": f"127.0.0.1:{health_port}", "PATH": "/usr/bin:/bin"}
        result = subprocess.run([sys.executable, "-c", check[3]], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{name}: {result.stderr}"
