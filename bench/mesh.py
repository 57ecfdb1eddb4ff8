"""A whole mesh for benchmarks: five processes on ephemeral ports, a private data dir and
Redis database, the prepared models.

The Redis is the one LLMESH_TEST_REDIS_URL names, else a scratch embedded server (the wheel's
valkey-server) started for the run: nothing assumes a Redis on 127.0.0.1:6379."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from llmesh.supervisor import Mesh
from llmesh.testing import TestRedis, real_models_dir

BENCH_REDIS_DB = 12


@contextlib.contextmanager
def bench_mesh(
    env: Mapping[str, str] | None = None, redis_db: int = BENCH_REDIS_DB, services: tuple[str, ...] | None = None
) -> Iterator[Mesh]:
    """`redis_db`: the database on a named server (LLMESH_TEST_REDIS_URL); flushed before and after."""
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-") as data:
        redis = TestRedis.start(Path(data) / "redis")
        try:
            url = redis.url(redis_db % redis.databases)
            _flush(url)
            base = {
                "LLMESH_DATA_DIR": data,
                "LLMESH_MODELS_DIR": str(real_models_dir()),
                "LLMESH_REDIS_URL": url,
                "LLMESH_LOG_LEVEL": "WARNING",
                # Benchmarks measure the serving path, not admission: a budget no run reaches.
                "LLMESH_ADMISSION_BUDGET": "1e12",
                "LLMESH_ADMISSION_TENANT_SHARE": "1",
                **(env or {}),
            }
            with Mesh(env=base, **({"services": services} if services else {})) as mesh:
                yield mesh
            _flush(url)
        finally:
            redis.stop()


def _flush(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as client:
        client.flushdb()
