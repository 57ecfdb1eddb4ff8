"""`llmesh up` on a machine without Redis: with LLMESH_REDIS_URL unset the supervisor runs the
embedded redis-server, the second `llmesh ask` is an exact cache hit (and says so); with no
state Redis named it runs the embedded state server too, and the Batch API takes a job (no 503)
while admission stays per process; stopping the mesh stops both servers with no process left
behind.

The machine's own Redis on 6379 is left alone: the embedded servers get free ports."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import openai
import psutil
import pytest
import redis

from llmesh.client import Mesh
from llmesh.redis_server import up_state_default
from llmesh.supervisor import Mesh as Processes
from llmesh.testing import REPO_ROOT, free_port
from llmesh.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUESTION = "Name one colour of the rainbow."


def ask_cli(target: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmesh.cli", "ask", QUESTION, "--target", target, "--max-new-tokens", "8", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


def test_embedded_redis_gives_a_cache_hit_and_stops_with_the_mesh(
    models_dir: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("LLMESH_REDIS_URL", "LLMESH_ADMISSION_REDIS_URL", "LLMESH_STATE_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)
    port, state_port = free_port(), free_port()
    env = {
        "LLMESH_DATA_DIR": "data",  # relative, as `.data` is for `make run`: resolved against cwd
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_EMBEDDED_REDIS_PORT": str(port),
        "LLMESH_EMBEDDED_REDIS_STATE_PORT": str(state_port),
        "LLMESH_MAX_BATCH_SIZE": "4",
    }
    # What `llmesh up` adds to its environment (cmd_up): the embedded state Redis.
    env.update(up_state_default({**os.environ, **env}))
    mesh = Processes(env=env, cwd=tmp_path)
    assert "LLMESH_REDIS_URL" not in mesh.base_env and "LLMESH_ADMISSION_REDIS_URL" not in mesh.base_env
    with mesh:
        assert mesh.redis is not None and mesh.redis.proc is not None
        assert mesh.redis.directory == tmp_path / "data" / "redis"
        assert mesh.redis_state is not None and mesh.redis_state.proc is not None
        assert mesh.redis_state.directory == tmp_path / "data" / "redis-state"
        redis_pid = mesh.redis.proc.pid
        pids = [redis_pid, mesh.redis_state.proc.pid, *(sp.proc.pid for sp in mesh.procs.values())]
        gateway = mesh.target("gateway")

        first = ask_cli(gateway)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip()
        assert "served from the cache" not in first.stderr
        assert "no cache" not in first.stderr, first.stderr

        second = ask_cli(gateway)
        assert second.returncode == 0, second.stderr
        assert second.stdout == first.stdout
        assert "llmesh: served from the cache (exact match)" in second.stderr

        with Mesh(gateway, timeout=60) as client:
            answer = client.ask(QUESTION, max_new_tokens=8)
        assert answer.cache.hit and answer.cache.tier == common_pb2.CACHE_TIER_EXACT
        assert not answer.degradations

        # The answer lives in the embedded server, not in the machine's Redis, behind its password.
        with redis.Redis.from_url(mesh.redis.url) as embedded:
            assert embedded.dbsize() > 0
            assert any(b"cache" in key for key in embedded.scan_iter(count=100))
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.dbsize()

        # The Batch API answers on a mesh started as `llmesh up` is, its job in the state server.
        line = {
            "custom_id": "q1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4},
        }
        base_url = mesh.procs["gateway"].http_base_url()
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
            uploaded = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
            job = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert job.request_counts is not None and job.request_counts.total == 1
            assert client.batches.retrieve(job.id).id == job.id
        state = tmp_path / "data" / "redis-state"
        assert stat.S_IMODE((state / "password").stat().st_mode) == 0o600
        with redis.Redis.from_url(mesh.redis_state.url) as store:
            assert store.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
            assert store.config_get("appendonly") == {"appendonly": "yes"}
            assert any(job.id.encode() in key for key in store.scan_iter(count=1000))
            # The admission window stays per process: nothing of it in the state server.
            keys = list(store.scan_iter(count=1000))
            assert not any(b"llmesh:admission" in key or b"llmesh:keylimit" in key for key in keys)

    assert mesh.redis is None and mesh.redis_state is None
    assert not any(psutil.pid_exists(pid) for pid in pids), "a process of the mesh outlived it"
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid in pids or "redis" in p.name()]
    assert (tmp_path / "data" / "redis" / "dump.rdb").is_file(), "the cache was not persisted under the data dir"
    assert (tmp_path / "data" / "redis-state" / "dump.rdb").is_file(), "the state was not persisted"
    with redis.Redis(port=port, socket_connect_timeout=0.5) as gone, pytest.raises(redis.ConnectionError):
        gone.ping()
    assert os.path.exists(tmp_path / "data" / "redis" / "redis.log")
