"""Breaker gauges carry the service, model and method of each breaker, not only its name."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.gateway.breaker import State
from services.gateway.peers import breaker_labels
from services.gateway.servicer import breaker_listener


def test_breaker_names_split_into_service_model_and_method() -> None:
    assert breaker_labels("inference") == ("inference", "", "")
    assert breaker_labels("inference/smollm2") == ("inference", "smollm2", "")
    assert breaker_labels("inference/smollm2:info") == ("inference", "smollm2", "info")
    assert breaker_labels("retrieval:ingest") == ("retrieval", "", "ingest")


def test_a_transition_sets_the_gauge_under_model_and_method_labels() -> None:
    on_transition = breaker_listener("inference/tiny-gauge:info")
    labels = {"peer": "inference/tiny-gauge:info", "service": "inference", "model": "tiny-gauge", "method": "info"}
    assert REGISTRY.get_sample_value("llmesh_gateway_breaker_state", labels) == 0
    on_transition(State.CLOSED, State.OPEN, "test")
    assert REGISTRY.get_sample_value("llmesh_gateway_breaker_state", labels) == 2
    moved = {**labels, "from_state": "closed", "to_state": "open"}
    assert REGISTRY.get_sample_value("llmesh_gateway_breaker_transitions_total", moved) == 1
