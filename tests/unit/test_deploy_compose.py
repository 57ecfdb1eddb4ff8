"""docker-compose.yml (and the GPU override) against the code: `docker-compose config` accepts
them, and every llmesh service runs its own module on the ports, settings and health check
that llmesh/settings.py declares."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmesh import settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
DOCKERFILE = ROOT / "Dockerfile"
# Standard variables read by libraries, allowed beside the declared ones.
STANDARD_PREFIXES = ("OTEL_", "HF_")
MODEL_READERS = ("tokenizer", "inference", "cache", "retrieval")
# Jobs that run once and exit (the others are long-running with a health check).
ONE_SHOT_JOBS = ("models", "models-import", "models-gguf", "certs", "keys")
# The only services that publish host ports: the gateway (the callers' door) and the operators'
# UIs (Jaeger, Prometheus, Grafana), all on 127.0.0.1. Everything else is internal.
PUBLISHING = ("gateway", "jaeger", "prometheus", "grafana")
GATEWAY_PUBLISHED = {settings.DEFAULT_PORTS["gateway"], settings.DEFAULT_HTTP_PORT}
KEYS_SCRIPT = ROOT / "scripts" / "mesh-keys.sh"


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path.name} is not a mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def container_ports(service: dict[str, Any]) -> set[int]:
    ports: set[int] = set()
    for entry in service.get("ports") or []:
        text = str(entry["target"] if isinstance(entry, dict) else entry).split("/")[0]
        ports.add(int(text.rsplit(":", 1)[-1]))
    ports.update(int(str(p).split("/")[0]) for p in service.get("expose") or [])
    return ports


def dockerfile_entrypoints() -> dict[str, list[str]]:
    """ENTRYPOINT of each named stage of the Dockerfile (exec form)."""
    stages: dict[str, list[str]] = {}
    current = None
    for line in DOCKERFILE.read_text().splitlines():
        stage = re.match(r"\s*FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if stage:
            current = stage.group(1)
            continue
        entry = re.match(r"\s*ENTRYPOINT\s+(\[.*\])\s*$", line)
        if entry and current:
            stages[current] = yaml.safe_load(entry.group(1))
    return stages


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_compose_config_is_accepted(files: tuple[Path, ...]) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no docker-compose binary nor docker compose plugin (Debian: apt-get install docker-compose)")
    args = [*command]
    for path in files:
        args += ["-f", str(path)]
    result = subprocess.run([*args, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or result.stdout


def test_every_llmesh_service_runs_its_own_module(services: dict[str, dict[str, Any]]) -> None:
    entrypoints = dockerfile_entrypoints()
    for name in settings.SERVICES:
        assert name in services, f"compose has no {name} service"
        svc = services[name]
        assert svc["build"]["target"] == name, f"{name} builds Dockerfile target {svc['build'].get('target')}"
        command = svc.get("entrypoint") or entrypoints.get(name) or []
        module = ["python", "-m", f"services.{name}"]
        if name == "gateway":
            # A shell that reads the admin key file, then becomes the module (exec: signals reach it).
            assert command[:2] == ["sh", "-c"] and command[2].endswith("; exec " + " ".join(module)), command
        else:
            assert command == module, f"{name} runs {command}"
        assert "command" not in svc, f"{name} overrides the image command"


def test_ports_match_settings_defaults(services: dict[str, dict[str, Any]]) -> None:
    for name in settings.SERVICES:
        env = env_of(services[name])
        port, metrics = settings.DEFAULT_PORTS[name], settings.DEFAULT_METRICS_PORTS[name]
        assert env["LLMESH_LISTEN"] == f"0.0.0.0:{port}", name
        assert env.get("LLMESH_METRICS_PORT", str(metrics)) == str(metrics), name
        assert env["LLMESH_METRICS_HOST"] == "0.0.0.0", f"{name}: metrics must be reachable by Prometheus"
        assert {port, metrics} <= container_ports(services[name]), f"{name} does not expose {port}/{metrics}"
    http = settings.DEFAULT_HTTP_PORT
    assert env_of(services["gateway"])["LLMESH_HTTP_LISTEN"] == f"0.0.0.0:{http}"
    assert http in container_ports(services["gateway"]), "the gateway does not publish its HTTP API"


def test_env_names_are_declared_for_the_service(services: dict[str, dict[str, Any]]) -> None:
    for name in settings.SERVICES:
        for var in env_of(services[name]):
            if var.startswith(STANDARD_PREFIXES):
                continue
            declared = settings.BY_ENV.get(var)
            assert declared is not None, f"{name} sets {var}, which llmesh/settings.py does not declare"
            assert name in declared.services, f"{name} sets {var}, read only by {declared.services}"
    # The models job runs the CLI, which reads every declared setting.
    for var in env_of(services["models"]):
        assert var.startswith(STANDARD_PREFIXES) or var in settings.BY_ENV, f"models sets {var}"


def test_peer_targets_point_at_the_peer_services(services: dict[str, dict[str, Any]]) -> None:
    for name in settings.SERVICES:
        for var, value in env_of(services[name]).items():
            if not (var.startswith("LLMESH_") and var.endswith("_TARGET")):
                continue
            peer = var.removeprefix("LLMESH_").removesuffix("_TARGET").lower()
            assert value == f"{peer}:{settings.DEFAULT_PORTS[peer]}", f"{name}: {var}={value}"
            assert services[name]["depends_on"][peer]["condition"] == "service_healthy", (name, peer)
    gateway_targets = {v for v in env_of(services["gateway"]) if v.endswith("_TARGET")}
    expected = {s.env for s in settings.DECLARED if s.env.endswith("_TARGET") and "gateway" in s.services}
    # With LLMESH_MODELS, each model's inference target is there instead of LLMESH_INFERENCE_TARGET.
    assert "LLMESH_MODELS" in env_of(services["gateway"])
    assert gateway_targets == expected - {"LLMESH_INFERENCE_TARGET"}


def test_two_models_each_with_its_own_inference_service(services: dict[str, dict[str, Any]]) -> None:
    """LLMESH_MODELS names two models; each target is an inference service of this file serving
    that model, with its own certificate (SAN = its service name, issued by the certs job) and
    mutual TLS; the gateway waits for each, and the tokenizer serves every model's tokenizer."""
    gateway = env_of(services["gateway"])
    models = settings.parse_models(gateway["LLMESH_MODELS"])
    assert len(models) == 2 and gateway["LLMESH_DEFAULT_MODEL"] == next(iter(models)) == "smollm2"
    extra_certs = env_of(services["certs"]).get("MESH_EXTRA_SERVICES", "").replace(",", " ").split()
    for model, target in models.items():
        host, _, port = target.rpartition(":")
        assert port == str(settings.DEFAULT_PORTS["inference"]), target
        svc = services[host]
        env = env_of(svc)
        assert svc["build"]["target"] == "inference" and "command" not in svc, host
        assert env["LLMESH_INFERENCE_MODEL"] == model, host
        assert env["LLMESH_LISTEN"] == f"0.0.0.0:{port}", host
        assert {int(port), settings.DEFAULT_METRICS_PORTS["inference"]} <= container_ports(svc), host
        for var in env:
            assert var.startswith(STANDARD_PREFIXES) or "inference" in settings.BY_ENV[var].services, (host, var)
        assert env["LLMESH_TLS_CERT"] == f"/certs/{host}/tls.crt", host
        assert env["LLMESH_TLS_KEY"] == f"/certs/{host}/tls.key", host
        assert env["LLMESH_TLS_CLIENT_CA"] == env["LLMESH_TLS_CA"] == f"/certs/{host}/ca.crt", host
        assert host == "inference" or host in extra_certs, f"the certs job issues no certificate for {host}"
        assert "certs:/certs:ro" in svc["volumes"] and "models:/data/models:ro" in svc["volumes"], host
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully", host
        assert svc.get("healthcheck"), host
        assert services["gateway"]["depends_on"][host]["condition"] == "service_healthy", host
    assert settings.BY_ENV["LLMESH_TOKENIZER_MODELS"].parse(
        env_of(services["tokenizer"])["LLMESH_TOKENIZER_MODELS"]
    ) == tuple(models)
    # The second model is imported once, after the packaged ones are prepared.
    job = services["models-import"]
    assert "llmesh models import" in " ".join(job["entrypoint"]) and "--name assistant" in " ".join(job["entrypoint"])
    assert job["depends_on"]["models"]["condition"] == "service_completed_successfully"
    assert services["inference-assistant"]["depends_on"]["models-import"]["condition"] == (
        "service_completed_successfully"
    )


def test_healthchecks_everywhere(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if name in ONE_SHOT_JOBS:
            assert svc.get("restart") == "no", f"{name} is a one-shot job"
            continue
        check = svc.get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
    for name in settings.SERVICES:
        test = " ".join(services[name]["healthcheck"]["test"])
        assert "grpc_health" in test and "HealthCheckRequest" in test and "SERVING" in test, name


def test_health_one_liner_is_valid_python(services: dict[str, dict[str, Any]]) -> None:
    test = services["gateway"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    compile(test[3], "<healthcheck>", "exec")
    # The service port requires mTLS: the check reads the plaintext health-only listener.
    assert "os.environ['LLMESH_HEALTH_LISTEN']" in test[3] and "insecure_channel" in test[3]


def test_every_service_runs_with_mutual_tls(services: dict[str, dict[str, Any]], compose: dict) -> None:
    """Each service serves TLS with its own certificate from the `certs` job and presents it to its
    peers; every internal service also requires a client certificate from the mesh CA. The gateway
    serves TLS to callers without requiring one (they authenticate with API keys)."""
    certs = services["certs"]
    assert certs["restart"] == "no" and certs.get("network_mode") == "none"
    assert "./scripts/mesh-certs.sh:/usr/local/bin/mesh-certs:ro" in certs["volumes"]
    assert certs["entrypoint"] == ["bash", "/usr/local/bin/mesh-certs"]
    entry = certs["command"]  # options, then the output folder (docs/deploy.md: rotation replaces them)
    assert entry[-1] == "/certs"
    ca_dir = entry[entry.index("--ca-dir") + 1]
    assert entry[entry.index("--owner") + 1] == "10001:10001", "the services run as uid 10001"
    volumes = {v.split(":")[1]: v.split(":")[0] for v in certs["volumes"]}
    assert volumes["/certs"] == "certs" and volumes[ca_dir] != "certs"
    assert {"certs", volumes[ca_dir]} <= set(compose["volumes"])
    for name in settings.SERVICES:
        svc = services[name]
        env = env_of(svc)
        assert env["LLMESH_TLS_CERT"] == f"/certs/{name}/tls.crt", name
        assert env["LLMESH_TLS_KEY"] == f"/certs/{name}/tls.key", name
        assert env["LLMESH_TLS_CA"] == f"/certs/{name}/ca.crt", name
        if name == "gateway":
            assert "LLMESH_TLS_CLIENT_CA" not in env, "callers reach the gateway without a client certificate"
        else:
            assert env["LLMESH_TLS_CLIENT_CA"] == f"/certs/{name}/ca.crt", f"{name} must require client certificates"
        assert "certs:/certs:ro" in svc["volumes"], name
        assert not any(v.split(":")[0] == volumes[ca_dir] for v in svc["volumes"]), f"{name} sees the CA key"
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        host, _, _ = env["LLMESH_HEALTH_LISTEN"].rpartition(":")
        assert host == "127.0.0.1", f"{name}: the plaintext health port must stay inside the container"


def test_depends_on_waits_for_health(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        depends = svc.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for dep, spec in depends.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            expected = "service_completed_successfully" if dep in ONE_SHOT_JOBS else "service_healthy"
            assert spec["condition"] == expected, f"{name} -> {dep}: {spec['condition']}"
            if expected == "service_healthy":
                assert services[dep].get("healthcheck"), f"{dep} has no healthcheck to wait for"


def test_models_volume_prepared_once_and_mounted(services: dict[str, dict[str, Any]], compose: dict) -> None:
    assert "models" in compose["volumes"]
    models = services["models"]
    assert models["build"]["target"] == "models"
    assert models["command"] == ["models", "prepare"]
    assert "models:/data/models" in models["volumes"]
    assert env_of(models)["LLMESH_DATA_DIR"] == "/data"
    for name in MODEL_READERS:
        svc = services[name]
        assert "models:/data/models:ro" in svc["volumes"], name
        assert svc["depends_on"]["models"]["condition"] == "service_completed_successfully", name
        assert env_of(svc)["LLMESH_DATA_DIR"] == "/data", name


def test_redis_requires_a_password(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    assert str(redis["image"]).startswith("redis:7")
    assert "--requirepass" in " ".join(redis["command"])
    url = env_of(services["cache"])["LLMESH_REDIS_URL"]
    match = re.fullmatch(r"redis://:(\$\{REDIS_PASSWORD:-[^}]+\})@redis:6379/\d+", url)
    assert match, f"cache must authenticate to redis: {url}"
    assert env_of(redis)["REDIS_PASSWORD"] == match.group(1), "cache and redis use different passwords"


def test_redis_memory_is_capped_and_evicts_only_cached_answers(services: dict[str, dict[str, Any]]) -> None:
    """Cached answers carry a TTL and may go; collection versions carry none and must stay
    (evicting one could serve an answer cached before an ingest): volatile-lru, as the embedded
    cache Redis runs."""
    command = " ".join(services["redis"]["command"])
    assert re.search(r"--maxmemory \d+mb\b", command), command
    assert "--maxmemory-policy volatile-lru" in command, command


def test_qdrant_requires_an_api_key(services: dict[str, dict[str, Any]]) -> None:
    qdrant = services["qdrant"]
    key = env_of(qdrant)["QDRANT__SERVICE__API_KEY"]
    assert key.startswith("${QDRANT_API_KEY")
    assert {6333, 6334} <= container_ports(qdrant) and "ports" not in qdrant, "Qdrant is internal"
    for name in ("cache", "retrieval"):
        env = env_of(services[name])
        assert env["QDRANT_URL"] == "http://qdrant:6333", name
        assert env["QDRANT_API_KEY"] == key, name
        assert services[name]["depends_on"]["qdrant"]["condition"] == "service_healthy"


def test_third_party_images_are_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if "build" in svc:
            continue
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: {image} is not pinned"
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", services["jaeger"]["image"])
    jaeger_ports = {p.rsplit(":", 2)[-1] for p in services["jaeger"]["ports"]}
    assert {"16686", "4317", "4318"} <= jaeger_ports
    for name in settings.SERVICES:
        assert env_of(services[name])["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name


def test_gpu_override() -> None:
    gpu = load(COMPOSE_GPU)["services"]
    assert set(gpu) == {"inference"}, "only inference runs on the GPU"
    inference = gpu["inference"]
    assert "ports" not in inference, "inference is internal on the GPU too"
    assert env_of(inference)["LLMESH_DEVICE"] == "cuda"
    assert "inference" in settings.BY_ENV["LLMESH_DEVICE"].services
    devices = inference["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "/whl/cu" in inference["build"]["args"]["TORCH_INDEX_URL"]
    for var in env_of(inference):
        assert var.startswith(STANDARD_PREFIXES) or "inference" in settings.BY_ENV[var].services


def test_backend_profiles_serve_the_model_the_inference_service_tokenizes(services: dict[str, dict[str, Any]]) -> None:
    inference = env_of(services["inference"])
    assert inference["LLMESH_INFERENCE_BACKEND"] == "${LLMESH_INFERENCE_BACKEND:-builtin}", "builtin by default"
    assert inference["LLMESH_BACKEND_MODEL"] == "smollm2" == inference["LLMESH_INFERENCE_MODEL"]
    assert inference["LLMESH_BACKEND_URLS"] == "${LLMESH_BACKEND_URLS:-http://vllm:8000/v1}"
    vllm, llamacpp = services["vllm"], services["llamacpp"]
    assert vllm["profiles"] == ["vllm"] and llamacpp["profiles"] == ["llamacpp"]
    assert "--served-model-name=smollm2" in vllm["command"] and "--port=8000" in vllm["command"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "--alias=smollm2" in llamacpp["command"] and "--port=8080" in llamacpp["command"]
    assert "deploy" not in llamacpp, "the llama.cpp profile is the CPU one"


def test_compose_config_with_the_backend_profiles_is_accepted() -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no docker-compose binary nor docker compose plugin (Debian: apt-get install docker-compose)")
    args = [*command, "-f", str(COMPOSE), "--profile", "vllm", "--profile", "llamacpp", "config", "-q"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or result.stdout


# ----------------------------------------------------------------------------- closed by default


def published(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host address, container port) of every published port (short and long syntax)."""
    found = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            found.append((str(entry.get("host_ip", "")), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        host_ip = parts[0] if len(parts) == 3 else ""
        found.append((host_ip, int(parts[-1])))
    return found


def test_only_the_gateway_publishes_a_mesh_port(services: dict[str, dict[str, Any]]) -> None:
    """Internal services and the stores are reachable inside the compose network only; what is
    published binds the host's loopback."""
    for name, svc in services.items():
        ports = published(svc)
        if name not in PUBLISHING:
            assert not ports, f"{name} publishes {ports}: internal services use `expose` only"
        for host_ip, port in ports:
            assert host_ip == "127.0.0.1", f"{name} publishes {port} on {host_ip or 'every interface'}"
    assert {port for _, port in published(services["gateway"])} == GATEWAY_PUBLISHED


def test_gateway_requires_api_keys_from_the_keys_job(services: dict[str, dict[str, Any]], compose: dict) -> None:
    """The gateway starts with authentication on: an API keys file and an admin key that the
    one-shot `keys` job generated into a volume only the job writes and only the gateway reads."""
    job, gateway = services["keys"], services["gateway"]
    assert job["restart"] == "no" and job.get("network_mode") == "none"
    assert f"./scripts/{KEYS_SCRIPT.name}:/usr/local/bin/mesh-keys:ro" in job["volumes"]
    assert job["entrypoint"] == ["bash", "/usr/local/bin/mesh-keys"]
    out = job["command"][-1]
    assert job["command"][job["command"].index("--owner") + 1] == "10001:10001", "the gateway runs as uid 10001"
    job_volumes = {v.split(":")[1]: v.split(":")[0] for v in job["volumes"]}
    volume = job_volumes[out]
    assert volume in compose["volumes"]

    env = env_of(gateway)
    assert "LLMESH_API_KEYS" not in env, "no key in the compose file: the job generates them"
    keys_file = Path(env["LLMESH_API_KEYS_FILE"])
    assert f"{volume}:{keys_file.parent}:ro" in gateway["volumes"]
    assert keys_file == Path(out) / "keys.json"
    wrapper = gateway["entrypoint"][2]
    assert f"cat {Path(out) / 'admin-key'}" in wrapper and "LLMESH_ADMIN_KEYS=" in wrapper, wrapper
    assert gateway["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    for name, svc in services.items():
        if name not in ("keys", "gateway"):
            assert not any(str(v).split(":")[0] == volume for v in svc.get("volumes") or []), f"{name} mounts the keys"


def run_keys_job(out: Path) -> subprocess.CompletedProcess[str]:
    # `llmesh` from this checkout, as the gateway image has it.
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        ["bash", str(KEYS_SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=60, check=True
    )


def test_keys_job_generates_once_and_prints_the_keys_once(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    first = run_keys_job(out)
    api = re.search(r"API key .*: (llmesh_\S+)$", first.stdout, re.MULTILINE)
    admin = re.search(r"admin key .*: (\S+)$", first.stdout, re.MULTILINE)
    assert api and admin, first.stdout
    (record,) = json.loads((out / "keys.json").read_text())["keys"]
    assert record["sha256"] == hashlib.sha256(api.group(1).encode()).hexdigest(), "the printed key is the filed one"
    assert api.group(1) not in (out / "keys.json").read_text(), "the file keeps a digest, never the key"
    assert (out / "admin-key").read_text().strip() == admin.group(1)
    settings.BY_ENV["LLMESH_ADMIN_KEYS"].parse(admin.group(1))  # long enough for the gateway
    for name in ("keys.json", "admin-key"):
        assert (out / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"
    before = {name: (out / name).read_bytes() for name in ("keys.json", "admin-key")}

    again = run_keys_job(out)
    assert "key" not in again.stdout, f"a second run printed {again.stdout!r}"
    assert {name: (out / name).read_bytes() for name in before} == before, "a second run regenerated the keys"


def test_gateway_entrypoint_exports_the_admin_key(services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """The entrypoint's shell hands the admin key file's content to the gateway as
    LLMESH_ADMIN_KEYS (a stand-in `python` prints what it received)."""
    script = services["gateway"]["entrypoint"][2].replace("$$", "$").replace("/keys/", f"{tmp_path}/")
    (tmp_path / "admin-key").write_text("llmesh-admin-0123456789abcdef\n")
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$LLMESH_ADMIN_KEYS|$*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30, check=True)
    assert result.stdout == "llmesh-admin-0123456789abcdef|-m services.gateway\n"
