"""Tracing must never hurt serving: with the OTLP endpoint unreachable, calls succeed without
added latency and the process still stops promptly."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc

from bench.common import percentile
from llmesh.supervisor import Mesh
from llmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc


def _latencies(target: str, n: int) -> list[float]:
    out = []
    with grpc.insecure_channel(target) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        for i in range(n):
            started = time.perf_counter()
            stub.Count(tokenizer_pb2.CountRequest(texts=[f"hello world {i}"]), timeout=5)
            out.append(time.perf_counter() - started)
    return out


def test_unreachable_collector_adds_no_latency_and_no_errors(models_dir: Path) -> None:
    base = {"LLMESH_MODELS_DIR": str(models_dir)}
    unreachable = {
        **base,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with Mesh(env=unreachable, services=("tokenizer",)) as traced, Mesh(env=base, services=("tokenizer",)) as plain:
        _latencies(traced.target("tokenizer"), 20)  # warm both
        _latencies(plain.target("tokenizer"), 20)
        on, off = [], []
        for _ in range(5):  # interleaved rounds: both see the same machine noise
            on += _latencies(traced.target("tokenizer"), 40)
            off += _latencies(plain.target("tokenizer"), 40)
        started = time.monotonic()
        code = traced.stop_one("tokenizer", timeout=30, sig=signal.SIGTERM)
        stop_seconds = time.monotonic() - started
    assert len(on) == len(off) == 200  # every call answered
    # Same latency within noise: the export runs on its own thread and gives up quietly.
    assert percentile(on, 0.5) <= percentile(off, 0.5) * 1.5 + 0.002, (percentile(on, 0.5), percentile(off, 0.5))
    assert code == 0
    assert stop_seconds < 15
