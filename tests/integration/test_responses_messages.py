"""OpenAI's Responses API and Anthropic's Messages API through the real gateway, on SmolLM2 (the
tokenizer, the builtin engine, the cache on real Redis; stored responses in the gateway's state
Redis), called with the official `openai` and `anthropic` clients as their docs show."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from llmesh.server import ServiceHost
from llmesh.testing import eventually, hosted
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

KEY = "test-key-acme-only-0123456789ab"
OTHER_KEY = "test-key-beta-only-0123456789ab"
FRESH = {"llmesh": {"use_retrieval": False, "use_cache": False}}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
async def gateway(models_dir: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str) -> AsyncIterator:
    prefix = f"llmesh-apis:{uuid.uuid4().hex[:8]}:"
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("apis-data")),
        "LLMESH_INFERENCE_MODEL": "smollm2",
        "LLMESH_REDIS_URL": module_redis_url,
        "QDRANT_URL": "",
    }
    try:
        async with (
            hosted("tokenizer", TokenizerApp, env) as tok,
            hosted("inference", InferenceApp, env) as inf,
            hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as cache,
        ):
            gateway_env = {
                **env,
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
                "LLMESH_API_KEYS": f"{KEY}=acme;{OTHER_KEY}=beta",
                # The replicas' shared state Redis: stored responses live there.
                "LLMESH_ADMISSION_REDIS_URL": module_redis_url,
                "LLMESH_ADMISSION_ADAPTIVE": "false",
            }
            async with hosted("gateway", GatewayApp, gateway_env) as gw:
                yield gw
    finally:
        client = redis.Redis.from_url(module_redis_url)
        for pattern in (f"{prefix}*", "llmesh:responses:*"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.delete(*keys)


def base_url(gw: ServiceHost) -> str:
    return f"http://127.0.0.1:{gw.app.http.port}"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def model(gateway: ServiceHost) -> str:
    async with openai.AsyncOpenAI(base_url=base_url(gateway) + "/v1", api_key=KEY) as c:
        return (await c.models.list()).data[0].id


@pytest.fixture
async def oai(gateway: ServiceHost) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url(gateway) + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
async def claude(gateway: ServiceHost) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=base_url(gateway), api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


async def test_responses_create_then_continue_with_previous_response_id(oai: openai.AsyncOpenAI, model: str) -> None:
    first = await oai.responses.create(
        model=model,
        instructions="Answer in one short sentence.",
        input="Name a colour of the sky.",
        max_output_tokens=16,
        extra_body=FRESH,
    )
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output[0].type == "message" and first.output_text
    assert first.usage is not None and 0 < first.usage.output_tokens <= 16
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    # Stored (the default): found again by id, as it was answered.
    again = await oai.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text

    # The next turn is given the first one: its prompt holds the first question and answer.
    second = await oai.responses.create(
        model=model,
        previous_response_id=first.id,
        input="And another one?",
        max_output_tokens=8,
        extra_body=FRESH,
    )
    alone = await oai.responses.create(model=model, input="And another one?", max_output_tokens=8, extra_body=FRESH)
    assert second.previous_response_id == first.id and second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    # A chain of three keeps every earlier turn.
    third = await oai.responses.create(
        model=model, previous_response_id=second.id, input="And another one?", max_output_tokens=4, extra_body=FRESH
    )
    assert third.usage is not None
    assert third.usage.input_tokens >= second.usage.input_tokens + second.usage.output_tokens


async def test_responses_stream_sends_the_documented_events(oai: openai.AsyncOpenAI, model: str) -> None:
    stream = await oai.responses.create(
        model=model, input="Write a short poem about the sea.", max_output_tokens=12, stream=True, extra_body=FRESH
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3  # token by token
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed",
    ]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == "".join(deltas) == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # A streamed response is stored too, and continues.
    final = events[-1].response
    follow = await oai.responses.create(
        model=model, previous_response_id=final.id, input="Shorter.", max_output_tokens=4, extra_body=FRESH
    )
    assert follow.usage is not None and final.usage is not None
    assert follow.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


async def test_responses_function_call_round_trip_and_json_schema(oai: openai.AsyncOpenAI, model: str) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
    called = await oai.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        extra_body=FRESH,
    )
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    # The call and its output go back as input items; the answer is text.
    answer = await oai.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=tools,  # type: ignore[arg-type]
        tool_choice="none",
        max_output_tokens=12,
        store=False,
        extra_body=FRESH,
    )
    assert answer.output[0].type == "message" and answer.output_text
    with pytest.raises(openai.NotFoundError):  # store=False: nothing kept
        await oai.responses.retrieve(answer.id)
    # text.format: a JSON schema the answer keeps to.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = await oai.responses.create(
        model=model,
        input="Is water wet? Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
        max_output_tokens=16,
        extra_body=FRESH,
    )
    assert isinstance(json.loads(shaped.output_text)["ok"], bool)


async def test_stored_responses_are_per_tenant_and_deleted(gateway: ServiceHost, model: str) -> None:
    async with httpx.AsyncClient(base_url=base_url(gateway), timeout=120) as http:
        mine = {"authorization": f"Bearer {KEY}"}
        theirs = {"authorization": f"Bearer {OTHER_KEY}"}
        body = {"model": model, "input": "Say hi.", "max_output_tokens": 4, **FRESH}
        created = (await http.post("/v1/responses", json=body, headers=mine)).json()
        path = f"/v1/responses/{created['id']}"
        assert (await http.get(path, headers=mine)).status_code == 200
        other = await http.get(path, headers=theirs)  # another tenant's id does not exist for it
        assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"
        assert (await http.delete(path, headers=theirs)).status_code == 404
        follow = {**body, "previous_response_id": created["id"]}
        refused = await http.post("/v1/responses", json=follow, headers=theirs)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
        deleted = await http.delete(path, headers=mine)
        assert deleted.status_code == 200 and deleted.json() == {
            "id": created["id"],
            "object": "response.deleted",
            "deleted": True,
        }
        assert (await http.get(path, headers=mine)).status_code == 404


async def test_responses_errors_in_openai_shape(gateway: ServiceHost, model: str) -> None:
    async with httpx.AsyncClient(base_url=base_url(gateway), timeout=60) as http:
        headers = {"authorization": f"Bearer {KEY}"}
        reasoning = {"model": model, "input": "x", "reasoning": {}}
        unknown = await http.post("/v1/responses", json=reasoning, headers=headers)
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "reasoning"
        tools = {"model": model, "input": "x", "tools": [{"type": "web_search"}]}
        assert (await http.post("/v1/responses", json=tools, headers=headers)).status_code == 400
        big = {"model": model, "input": "x", "max_output_tokens": 10**6}
        too_long = await http.post("/v1/responses", json=big, headers=headers)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_output_tokens"
        assert "max_output_tokens" in too_long.json()["error"]["message"]
        missing = await http.post("/v1/responses", json={"model": model, "input": "x"})
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


async def test_messages_create_whole_and_streamed(claude: anthropic.AsyncAnthropic, model: str) -> None:
    message = await claude.messages.create(
        model=model,
        max_tokens=12,
        system=[{"type": "text", "text": "You are terse."}],
        messages=[
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]},
        ],
        stop_sequences=["\n\n\n"],
        extra_body=FRESH,
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert 0 < message.usage.output_tokens <= 12 and message.usage.input_tokens > 10

    async with claude.messages.stream(
        model=model, max_tokens=12, messages=[{"role": "user", "content": "Tell me about whales."}], extra_body=FRESH
    ) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) >= 3 and "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    assert final.usage.input_tokens > 5  # from message_delta: known once the prompt was read


async def test_messages_forced_tool_use_streamed_and_round_trip(claude: anthropic.AsyncAnthropic, model: str) -> None:
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = await claude.messages.create(
        model=model,
        max_tokens=32,
        messages=ask,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=FRESH,
    )
    use = next(b for b in message.content if b.type == "tool_use")
    assert message.stop_reason == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input["city"], str)  # type: ignore[index]

    async with claude.messages.stream(
        model=model,
        max_tokens=32,
        messages=ask,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=FRESH,
    ) as stream:
        streamed = await stream.get_final_message()
    block = next(b for b in streamed.content if b.type == "tool_use")
    assert streamed.stop_reason == "tool_use" and block.name == "get_weather" and "city" in block.input  # type: ignore[operator]

    # The tool's result goes back as a tool_result block: the answer is text.
    answer = await claude.messages.create(
        model=model,
        max_tokens=12,
        messages=[
            *ask,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
        ],  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "none"},
        extra_body=FRESH,
    )
    assert answer.content[0].type == "text" and answer.content[0].text


async def test_messages_share_the_chat_cache_path(claude: anthropic.AsyncAnthropic, model: str) -> None:
    ask = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Count to three."}]}
    keep = {"llmesh": {"use_retrieval": False}}
    first = await claude.messages.create(**ask, extra_body=keep)  # type: ignore[arg-type]
    assert not first.model_extra["llmesh"]["cache_hit"]  # type: ignore[index]

    async def cached() -> Any:
        # The answer is stored after it is sent: the same request is a hit once it is there.
        again = await claude.messages.create(**ask, extra_body=keep)  # type: ignore[arg-type]
        return again if again.model_extra["llmesh"]["cache_hit"] else None  # type: ignore[index]

    again = await eventually(cached, 120, interval=0.5)
    assert again.content == first.content
    # A stop sequence shapes the answer: another entry, not the first one's.
    other = await claude.messages.create(**ask, stop_sequences=["four"], extra_body=keep)  # type: ignore[arg-type]
    assert not other.model_extra["llmesh"]["cache_hit"]  # type: ignore[index]


async def test_messages_errors_in_anthropic_shape(gateway: ServiceHost, model: str) -> None:
    async with httpx.AsyncClient(base_url=base_url(gateway), timeout=60) as http:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        ask = {"model": model, "messages": [{"role": "user", "content": "x"}]}
        missing = await http.post("/v1/messages", json=ask, headers=headers)  # max_tokens is required
        assert missing.status_code == 400
        error = missing.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in error["error"]["message"]
        unknown = await http.post("/v1/messages", json={**ask, "max_tokens": 4, "thinking": {}}, headers=headers)
        assert unknown.status_code == 400 and "thinking" in unknown.json()["error"]["message"]
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        images = {**ask, "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}
        refused = await http.post("/v1/messages", json=images, headers=headers)
        assert refused.status_code == 400 and refused.json()["type"] == "error"
        huge = await http.post("/v1/messages", json={**ask, "max_tokens": 10**6}, headers=headers)
        assert huge.status_code == 400 and "max_tokens" in huge.json()["error"]["message"]
        no_key = await http.post("/v1/messages", json={**ask, "max_tokens": 4})
        assert no_key.status_code == 401
        assert no_key.json() == {"type": "error", "error": {"type": "authentication_error", "message": ANY_TEXT}}
        bad_key = await http.post("/v1/messages", json={**ask, "max_tokens": 4}, headers={"x-api-key": "nope"})
        assert bad_key.status_code == 401 and bad_key.json()["error"]["type"] == "authentication_error"
        # The SDK raises its own typed errors from these.
        async with anthropic.AsyncAnthropic(base_url=base_url(gateway), api_key="wrong", max_retries=0) as c:
            with pytest.raises(anthropic.AuthenticationError):
                await c.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}])


class _AnyText(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)

    def __hash__(self) -> int:
        return 0


ANY_TEXT = _AnyText()
