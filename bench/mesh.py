"""A whole mesh for benchmarks: five processes on ephemeral ports, a private data dir and
Redis database, the prepared models."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping

import redis

from llmesh.supervisor import Mesh
from llmesh.testing import real_models_dir

BENCH_REDIS_DB = 12


@contextlib.contextmanager
def bench_mesh(
    env: Mapping[str, str] | None = None, redis_db: int = BENCH_REDIS_DB, services: tuple[str, ...] | None = None
) -> Iterator[Mesh]:
    url = f"redis://127.0.0.1:6379/{redis_db}"
    redis.Redis.from_url(url).flushdb()
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-") as data:
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
    redis.Redis.from_url(url).flushdb()
