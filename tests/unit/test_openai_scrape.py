"""The openai backend's load scrape asks the engine for the metrics it reads (prometheus_client's
`name[]` filter on vLLM's /metrics/ mount: 2.4 KB instead of 51 KB, a fifth of the API server's
time), uncompressed, and falls back to the whole /metrics on a server whose filtered answer
carries no load."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.inference.backend_load import SCRAPED
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend

URL = "http://10.0.0.1:8000/v1"
LOAD = "vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n"


@pytest.fixture
def tokenizer(models_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(models_dir, "smollm2")


async def backend_on(tokenizer: LocalTokenizer, handle: httpx.MockTransport) -> OpenAIBackend:
    backend = OpenAIBackend(BackendConfig(urls=(URL,), model="smollm2"), tokenizer)
    await backend.client.aclose()
    backend.client = httpx.AsyncClient(transport=handle)
    return backend


async def test_the_scrape_asks_only_for_the_metrics_it_reads_uncompressed(tokenizer: LocalTokenizer) -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text=LOAD)

    backend = await backend_on(tokenizer, httpx.MockTransport(handle))
    replica = backend.replicas[0]
    await backend._scrape(replica)
    await backend._scrape(replica)
    assert [r.url.path for r in seen] == ["/metrics/", "/metrics/"]
    assert seen[0].url.params.get_list("name[]") == list(SCRAPED)
    assert seen[0].headers["accept-encoding"] == "identity"
    assert replica.load.last is not None and replica.load.last.running == 3 and replica.load.last.waiting == 2
    await backend.client.aclose()


@pytest.mark.parametrize(
    "filtered",
    [httpx.Response(404, text="Not Found"), httpx.Response(307), httpx.Response(200, text="# a page, no metrics\n")],
    ids=["not-found", "redirect", "no-vllm-metrics"],
)
async def test_a_server_without_the_filtered_route_is_scraped_on_metrics(
    tokenizer: LocalTokenizer, filtered: httpx.Response
) -> None:
    paths: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, text=LOAD) if request.url.path == "/metrics" else filtered

    backend = await backend_on(tokenizer, httpx.MockTransport(handle))
    replica = backend.replicas[0]
    await backend._scrape(replica)
    await backend._scrape(replica)
    await backend._scrape(replica)
    assert paths == ["/metrics/", "/metrics", "/metrics"]
    assert replica.load.last is not None and replica.load.last.running == 3
    await backend.client.aclose()
