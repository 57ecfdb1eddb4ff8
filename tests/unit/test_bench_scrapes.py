"""The benchmarks' Prometheus scrapes, against a real endpoint served by prometheus_client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from bench.harness.scrapes import bucket_quantile, gauge, histogram, scrape


@pytest.fixture
def endpoint() -> Iterator[tuple[int, CollectorRegistry]]:
    registry = CollectorRegistry()
    server, thread = start_http_server(0, "127.0.0.1", registry)
    try:
        yield server.server_port, registry
    finally:
        server.shutdown()
        thread.join()


def test_gauges_histograms_and_the_gateways_breakers_are_read(endpoint: tuple[int, CollectorRegistry]) -> None:
    port, registry = endpoint
    Gauge("llmesh_gateway_admission_in_flight_limit", "limit", registry=registry).set(12.34)
    lag = Histogram("loop_lag_seconds", "lag", buckets=(0.01, 0.1, 1.0), registry=registry)
    for value in (0.005, 0.05, 0.05, 0.5):
        lag.observe(value)
    state = Gauge("llmesh_gateway_breaker_state", "state", ["peer"], registry=registry)
    state.labels("cache").set(2)
    moves = Counter(
        "llmesh_gateway_breaker_transitions", "moves", ["peer", "from_state", "to_state"], registry=registry
    )
    moves.labels("cache", "closed", "open").inc(3)

    assert gauge(port, "llmesh_gateway_admission_in_flight_limit") == pytest.approx(12.34)
    assert gauge(port, "absent") is None
    buckets = histogram(port, "loop_lag_seconds")
    assert buckets == {0.01: 1.0, 0.1: 3.0, 1.0: 4.0, float("inf"): 4.0}
    assert bucket_quantile({}, buckets, 0.5) == 0.1
    found = scrape(port)
    assert found["states"] == {"cache": 2}
    assert found["transitions"] == {"cache:closed->open": 3.0}
    assert found["admission"] == {"limit": 12.3}


def test_an_endpoint_that_does_not_answer_reads_as_nothing() -> None:
    assert gauge(1, "anything") is None
    assert histogram(1, "anything") == {}
