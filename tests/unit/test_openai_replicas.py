"""The openai backend's choice of replica: only healthy ones, fewest in flight, turns among equals;
none healthy is UNAVAILABLE with a retry delay, and the service is NOT_SERVING."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmesh import errors
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend

URLS = ("http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1")


@pytest.fixture
def backend(models_dir: Path) -> Iterator[OpenAIBackend]:
    tokenizer = LocalTokenizer.load(models_dir, "smollm2")
    yield OpenAIBackend(BackendConfig(urls=URLS, model="smollm2", health_interval_s=0.5), tokenizer)


def test_no_healthy_replica_is_unavailable_and_not_serving(backend: OpenAIBackend) -> None:
    assert not backend.serving
    with pytest.raises(errors.Unavailable) as down:
        backend._pick()
    assert down.value.retry_after == 0.5


def test_requests_go_to_healthy_replicas_with_fewest_in_flight(backend: OpenAIBackend) -> None:
    a, _, c = backend.replicas
    a.healthy = c.healthy = True
    assert backend.serving
    picked = {backend._pick().base_url for _ in range(6)}
    assert picked == {a.base_url, c.base_url}, "equals take turns; the unhealthy one gets nothing"
    a.in_flight = 3
    assert all(backend._pick() is c for _ in range(4))
    c.in_flight = 5
    assert backend._pick() is a


def test_model_info_is_the_backend_model_and_our_tokenizer(backend: OpenAIBackend, models_dir: Path) -> None:
    backend.replicas[1].healthy = True
    backend.replicas[1].engine = "vllm 0.32.0"
    backend.replicas[1].max_model_len = 2048
    info = backend.description
    assert (info.model_id, info.version, info.max_context_tokens) == ("smollm2", "vllm 0.32.0", 2048)
    assert len(info.digest) == 64 and info.device == URLS[1]
