"""Shared by the scale runs of bench.retrieval and bench.cache: fill the embedded store (Qdrant
Edge, through llmesh.edge_store as the services open it) with stored random unit vectors and
the payloads the services write, build its HNSW index, and time searches through the store.

Random vectors measure the store, not MiniLM: at 100k points the embedding model would take an
hour to produce them on two cores, and the search cost does not depend on where vectors came from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from qdrant_client import models as qm

from bench.common import percentile
from llmesh.edge_store import EdgeClient

FILL_BATCH = 2000


def unit_vectors(n: int, dim: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v


def fill(
    client: EdgeClient,
    collection: str,
    n: int,
    dim: int,
    payload: Callable[[int], dict[str, Any]],
    point_id: Callable[[int], str],
    indexes: Sequence[tuple[str, qm.PayloadSchemaType]],
    seed: int = 1,
) -> dict[str, float]:
    """Creates the collection with its payload indexes, upserts n points, builds the HNSW index
    (the services' background build, waited for here, at normal priority); returns the seconds taken."""
    client.create_collection(collection, vectors_config=qm.VectorParams(size=dim, distance=qm.Distance.DOT))
    for name, schema in indexes:
        client.create_payload_index(collection, name, schema)
    started = time.perf_counter()
    for first in range(0, n, FILL_BATCH):
        count = min(FILL_BATCH, n - first)
        vectors = unit_vectors(count, dim, seed + first)
        ids = [point_id(i) for i in range(first, first + count)]
        client.upsert_arrays(collection, ids, vectors, [payload(i) for i in range(first, first + count)])
    upserted = time.perf_counter()
    client.build_index(collection, nice=0)  # nothing is served meanwhile: no need to yield the cores
    built = time.perf_counter()
    points, indexed = client.indexed(collection)
    return {
        "points": points,
        "indexed_vectors": indexed,
        "upsert_seconds": round(upserted - started, 2),
        "index_build_seconds": round(built - upserted, 2),
    }


def time_searches(
    client: EdgeClient, collection: str, queries: np.ndarray, flt: qm.Filter | None, with_payload: Any = True
) -> dict[str, float]:
    """p50/p99 (ms) of top-4 searches through the store's client, as the services call it."""
    times = []
    for q in queries:
        vector = q.tolist()
        t0 = time.perf_counter()
        client.query_points(collection, query=vector, query_filter=flt, limit=4, with_payload=with_payload)
        times.append(time.perf_counter() - t0)
    return {"p50_ms": round(percentile(times, 0.5) * 1000, 3), "p99_ms": round(percentile(times, 0.99) * 1000, 3)}


def ms_percentiles(times: Sequence[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(times, 0.5) * 1000, 2), "p99_ms": round(percentile(times, 0.99) * 1000, 2)}


def others_running() -> list[str]:
    """Other heavy processes on this (shared) machine while the benchmark ran, for the record."""
    mine = os.getpid()
    seen: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == mine:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        for marker in ("pytest", "bench.", "pip ", "pip-compile", "llmesh.supervisor", "services.", "mypy", "make "):
            if marker in cmd:
                seen[marker.strip()] = seen.get(marker.strip(), 0) + 1
                break
    return [f"{name} x{count}" for name, count in sorted(seen.items())]
