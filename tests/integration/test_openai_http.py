"""The gateway's OpenAI-compatible HTTP API on real servers (tokenizer, tiny-model inference,
cache on real Redis), called with the official `openai` client exactly as a user would
(base_url=http://127.0.0.1:PORT/v1), and with plain HTTP where the client hides the wire."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client import REGISTRY

from llmesh.server import ServiceHost
from llmesh.testing import hosted, service_settings
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

KEY = "test-key-all-tenants-0123456789"
ACME_KEY = "test-key-acme-only-0123456789ab"
NO_RETRIEVAL = {"llmesh": {"use_retrieval": False}}
MODEL = "tiny-random-llama-0"


@pytest.fixture(scope="module")
async def backends(
    models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[dict]:
    prefix = f"llmesh-http:{uuid.uuid4().hex[:8]}:"
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("http-data")),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": module_redis_url,
        "QDRANT_URL": "",
    }
    try:
        async with (
            hosted("tokenizer", TokenizerApp, env) as tok,
            hosted("inference", InferenceApp, env) as inf,
            hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as cache,
        ):
            yield {
                **env,
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
            }
    finally:
        client = redis.Redis.from_url(module_redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="module")
async def gateway(backends: dict) -> AsyncIterator[ServiceHost]:
    env = {**backends, "LLMESH_API_KEYS": f"{KEY}=*;{ACME_KEY}=acme", "LLMESH_MAX_PROMPT_TOKENS": "200"}
    async with hosted("gateway", GatewayApp, env) as gw:
        yield gw


def base_url(gw: ServiceHost) -> str:
    return f"http://127.0.0.1:{gw.app.http.port}/v1"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def client(gateway: ServiceHost) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url(gateway), api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def http_requests(route: str, status: int) -> float:
    labels = {"route": route, "method": "POST", "status": str(status)}
    return REGISTRY.get_sample_value("llmesh_gateway_http_requests_total", labels) or 0.0


async def test_chat_answer(client: openai.AsyncOpenAI) -> None:
    before = http_requests("/v1/chat/completions", 200)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}],
        max_tokens=8,
        extra_body=NO_RETRIEVAL,
    )
    answer = raw.parse()
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > 5 and 0 < answer.usage.completion_tokens <= 8
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert raw.headers["x-request-id"] and answer.id == f"chatcmpl-{raw.headers['x-request-id']}"
    extension = answer.model_extra["llmesh"]  # type: ignore[index]
    assert raw.headers.get("x-trace-id", "") == extension["trace_id"]  # none here: tracing is off in tests
    assert "retrieval_unavailable" not in extension["degradations"]
    assert http_requests("/v1/chat/completions", 200) == before + 1
    # The same question again is an exact cache hit with the same text: one pipeline, one cache.
    again = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}],
        max_tokens=8,
        extra_body=NO_RETRIEVAL,
    )
    assert again.choices[0].message.content == answer.choices[0].message.content
    assert again.model_extra["llmesh"]["cache"] == {"hit": True, "tier": "exact", "similarity": 1.0}  # type: ignore[index]


async def test_streamed_chat_answer_in_chunks_with_finish_reason_and_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me a story about a fox {uuid.uuid4().hex[:6]}."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"llmesh": {"use_retrieval": False, "use_cache": False}},
    )
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 3, chunks  # the answer arrives token by token
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12 or finishes == ["stop"]
    assert last.usage.prompt_tokens > 5 and last.usage.total_tokens > last.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


async def test_plain_completion_and_streamed_completion(client: openai.AsyncOpenAI) -> None:
    done = await client.completions.create(model=MODEL, prompt="Say hello.", max_tokens=6, extra_body=NO_RETRIEVAL)
    assert done.object == "text_completion" and done.choices[0].text
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage is not None
    pieces = [
        chunk.choices[0].text
        async for chunk in await client.completions.create(
            model=MODEL, prompt="Say hello.", max_tokens=6, stream=True, extra_body=NO_RETRIEVAL
        )
        if chunk.choices
    ]
    assert "".join(pieces) == done.choices[0].text  # a cache hit, streamed


async def test_model_list_names_every_served_model(client: openai.AsyncOpenAI, gateway: ServiceHost) -> None:
    listed = [m.id async for m in client.models.list()]
    served = await gateway.app.gateway.served_models(_deadline())  # type: ignore[attr-defined]
    assert listed == served == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")


async def test_a_request_resolves_its_model_once(
    client: openai.AsyncOpenAI, gateway: ServiceHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The adapter's model check resolves it, and the request path goes on with that resolution.
    core = gateway.app.gateway  # type: ignore[attr-defined]
    resolved: list[str] = []
    route, served_models = core.route, core.served_models

    async def counted(model: str, deadline: Any) -> Any:
        resolved.append(model)
        return await route(model, deadline)

    async def listed(deadline: Any) -> Any:
        resolved.append("(the list)")
        return await served_models(deadline)

    monkeypatch.setattr(core, "route", counted)
    monkeypatch.setattr(core, "served_models", listed)
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Once {uuid.uuid4().hex}?"}],
        max_tokens=2,
        extra_body=NO_RETRIEVAL,
    )
    assert resolved == [MODEL]


def _deadline() -> Any:
    from services.gateway.peers import Deadline

    return Deadline.after(10)


def assert_openai_error(body: Any, param: str | None = None) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"model": MODEL, "messages": CHAT, "temperature": 7}, 400, "temperature"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": "no-such-model", "messages": CHAT}, 404, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 40_000}]}, 400, "messages"),
        ({"model": MODEL, "messages": CHAT, "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
        # Tools without a tool choice is "auto": text or calls, never also a response format.
        (
            {
                "model": MODEL,
                "messages": CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "response_format": {"type": "json_object"},
            },
            400,
            "response_format",
        ),
        ({"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages"),
    ],
    ids=[
        "temperature-7",
        "empty-messages",
        "unknown-model",
        "past-token-limit",
        "past-byte-limit",
        "n-17",
        "top_logprobs-alone",
        "tools-auto-with-response-format",
        "no-user",
    ],
)
async def test_bad_requests_get_4xx_openai_errors(
    client: openai.AsyncOpenAI, kwargs: dict, status: int, param: str | None
) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(**kwargs, max_tokens=4, extra_body=NO_RETRIEVAL)
    assert info.value.status_code == status
    assert_openai_error(info.value.response.json(), param)


async def test_unknown_parameter_and_bad_json_are_400(gateway: ServiceHost) -> None:
    async with httpx.AsyncClient(base_url=base_url(gateway), headers={"authorization": f"Bearer {KEY}"}) as http:
        unknown = await http.post("/chat/completions", json={"model": MODEL, "messages": CHAT, "frobnicate": 1})
        garbage = await http.post(
            "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        # A list of token ids is a prompt (a raw completion); an object is not.
        wrong_type = await http.post("/completions", json={"model": MODEL, "prompt": {"text": "hi"}})
        huge = await http.post("/completions", content=b"x" * (9 * 1024 * 1024))
        no_route = await http.get("/engines")
    assert unknown.status_code == 400 and "frobnicate" in assert_openai_error(unknown.json(), "frobnicate")["message"]
    assert garbage.status_code == 400 and assert_openai_error(garbage.json())
    assert wrong_type.status_code == 400 and assert_openai_error(wrong_type.json())["param"].startswith("prompt")
    assert huge.status_code == 413 and assert_openai_error(huge.json())
    assert no_route.status_code == 404 and assert_openai_error(no_route.json())


async def test_keys_are_checked_and_tenants_come_from_the_key(gateway: ServiceHost) -> None:
    async with openai.AsyncOpenAI(base_url=base_url(gateway), api_key="wrong-key-0123456789", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as wrong:
            await bad.chat.completions.create(model=MODEL, messages=CHAT, temperature=7)  # 401 before the body
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    assert assert_openai_error(wrong.value.response.json())["code"] == "api_key_invalid"
    async with openai.AsyncOpenAI(base_url=base_url(gateway), api_key=ACME_KEY, max_retries=0, timeout=60) as acme:
        ok = await acme.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=NO_RETRIEVAL)
        assert ok.choices[0].message.content is not None  # acts for its only tenant, acme
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await acme.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4, extra_body={"llmesh": {"tenant": "beta"}}
            )
    assert assert_openai_error(denied.value.response.json())["code"] == "tenant_not_owned"


async def test_traceparent_continues_the_callers_trace(client: openai.AsyncOpenAI) -> None:
    trace_id = uuid.uuid4().hex
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        extra_body=NO_RETRIEVAL,
        extra_headers={"traceparent": f"00-{trace_id}-{'ab' * 8}-01", "x-request-id": "my-request-1"},
    )
    assert raw.headers["x-trace-id"] == trace_id and raw.headers["x-request-id"] == "my-request-1"
    assert raw.parse().model_extra["llmesh"]["trace_id"] == trace_id  # type: ignore[index]


async def test_shed_request_gets_429_with_retry_after(backends: dict) -> None:
    env = {
        **backends,
        "LLMESH_ADMISSION_BUDGET": "400",
        "LLMESH_ADMISSION_DEGRADE": "false",
        "LLMESH_ADMISSION_TENANT_SHARE": "1",
    }
    async with hosted("gateway", GatewayApp, env) as gw, httpx.AsyncClient(base_url=base_url(gw), timeout=60) as http:
        statuses = []
        for i in range(20):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 4}
            reply = await http.post("/chat/completions", json={**body, "llmesh": {"use_cache": False}})
            statuses.append(reply.status_code)
            if reply.status_code != 200:
                break
        # Streamed requests are refused the same way, before the first byte.
        streamed = await http.post("/chat/completions", json={**body, "stream": True, "llmesh": {"use_cache": False}})
    assert statuses[:-1] == [200] * (len(statuses) - 1) and statuses[-1] == 429, statuses
    for shed in (reply, streamed):
        assert shed.status_code == 429
        assert 1 <= int(shed.headers["retry-after"]) <= 10 and int(shed.headers["retry-after-ms"]) > 0
        assert "total;dur=" in shed.headers["server-timing"]
        assert assert_openai_error(shed.json())["type"] == "rate_limit_error"


async def test_stream_is_sse_in_openai_chunk_format(gateway: ServiceHost) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True, **NO_RETRIEVAL}
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base_url(gateway), headers=headers, timeout=60) as http:
        async with http.stream("POST", "/chat/completions", json=body) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([part async for part in reply.aiter_bytes()]).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_stream_in_flight_finishes_while_the_gateway_drains(backends: dict) -> None:
    settings = service_settings("gateway", backends)
    host = ServiceHost(GatewayApp(settings), settings)
    await host.start()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 16, "stream": True, "llmesh": {"use_cache": False}}
    stopping: asyncio.Task[None] | None = None
    try:
        async with httpx.AsyncClient(base_url=base_url(host), timeout=60) as http:
            async with http.stream("POST", "/chat/completions", json=body) as reply:
                lines = reply.aiter_lines()
                first = await anext(lines)
                stopping = asyncio.create_task(host.stop(grace=30))
                rest = [line async for line in lines if line]
            await stopping
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                await http.post("/chat/completions", json=body)
    finally:
        await (stopping if stopping is not None else host.stop(grace=1))
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]", rest
    assert any('"finish_reason":"length"' in line or '"finish_reason":"stop"' in line for line in rest)


async def test_https_with_the_gateways_tls_settings(backends: dict, mesh_certs: Path) -> None:
    """With LLMESH_TLS_CERT and LLMESH_TLS_CLIENT_CA the HTTP API is HTTPS with client certificates,
    as the gRPC port is."""
    tls = {
        "LLMESH_TLS_CERT": str(mesh_certs / "gateway" / "tls.crt"),
        "LLMESH_TLS_KEY": str(mesh_certs / "gateway" / "tls.key"),
        "LLMESH_TLS_CLIENT_CA": str(mesh_certs / "gateway" / "ca.crt"),
    }
    async with hosted("gateway", GatewayApp, {**backends, **tls}) as gw:
        url = base_url(gw).replace("http://", "https://")
        ca = ssl.create_default_context(cafile=str(mesh_certs / "client" / "ca.crt"))
        with_cert = ssl.create_default_context(cafile=str(mesh_certs / "client" / "ca.crt"))
        with_cert.load_cert_chain(str(mesh_certs / "client" / "tls.crt"), str(mesh_certs / "client" / "tls.key"))
        async with openai.AsyncOpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=httpx.AsyncClient(verify=with_cert)
        ) as client:
            assert [m.id async for m in client.models.list()] == [MODEL]
        async with httpx.AsyncClient(verify=ca) as anonymous:
            with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake is refused
                await anonymous.get(f"{url}/models")


async def test_downstream_down_is_503_and_a_spent_deadline_504(backends: dict) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "llmesh": {"use_cache": False}}
    cases = [
        (503, "service_unavailable_error", {"LLMESH_INFERENCE_TARGET": "127.0.0.1:1"}),
        (504, "timeout_error", {"LLMESH_DEFAULT_DEADLINE_SECONDS": "0.001"}),
    ]
    for status, kind, env in cases:
        async with (
            hosted("gateway", GatewayApp, {**backends, **env}) as gw,
            httpx.AsyncClient(base_url=base_url(gw), timeout=60) as http,
        ):
            reply = await http.post("/chat/completions", json=body)
        assert reply.status_code == status, reply.text
        assert assert_openai_error(reply.json())["type"] == kind


async def test_embeddings_while_retrieval_is_down_are_a_503_and_not_listed(
    gateway: ServiceHost, client: openai.AsyncOpenAI
) -> None:
    # Retrieval (the embedding model's home) is at a closed port in this module.
    with pytest.raises(openai.APIStatusError) as info:
        await client.embeddings.create(model="all-MiniLM-L6-v2", input=["a"])
    assert info.value.status_code == 503
    assert [m.id async for m in client.models.list()] == [MODEL]
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base_url(gateway), headers=headers, timeout=60) as http:
        anonymous = await http.post("/embeddings", json={"model": "e", "input": "a"}, headers={"authorization": ""})
        assert anonymous.status_code == 401
        tokens = await http.post("/embeddings", json={"model": "e", "input": [[1, 2]]})
        assert tokens.status_code == 400 and tokens.json()["error"]["param"] == "input"
