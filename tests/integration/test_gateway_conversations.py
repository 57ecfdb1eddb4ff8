"""Conversations through the real gateway (gRPC and the OpenAI HTTP API) on real servers
(tokenizer, tiny-model inference, the cache on real Redis with its semantic tier): every turn is
rendered by the model's own template, retrieval searches with the last user turn, and the answer
cache never lets two conversations share an entry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel, Field

from llmesh.server import ServiceHost
from llmesh.testing import eventually, hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

MODEL = "tiny-random-llama-0"


@dataclass
class RecordingRetrieval(retrieval_pb2_grpc.RetrievalServicer):
    """A collection with one chunk; remembers every query it was searched with."""

    queries: list[str] = field(default_factory=list)

    async def GetCollectionInfo(self, request, context):  # type: ignore[no-untyped-def]
        return retrieval_pb2.CollectionInfo(exists=True, points=1, version=1, dimension=384)

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        self.queries.append(request.query)
        chunk = common_pb2.ScoredChunk(document_id="handbook", text="Employees get 25 vacation days.", score=0.9)
        return retrieval_pb2.RetrievalSearchResponse(results=[chunk], collection_version=1)


@dataclass
class Mesh:
    gateway: ServiceHost
    stub: gateway_pb2_grpc.GatewayStub
    retrieval: RecordingRetrieval
    inference: ServiceHost

    async def settle(self) -> None:
        await self.gateway.app.gateway.settle()  # type: ignore[attr-defined]

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.app.http.port}/v1"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def mesh(
    models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[Mesh]:
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("conversations")),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": module_redis_url,
        "LLMESH_MAX_NEW_TOKENS": "1500",
        "QDRANT_URL": "",
    }
    fake = RecordingRetrieval()
    server = grpc.aio.server()
    retrieval_pb2_grpc.add_RetrievalServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    prefix = f"llmesh-conv:{uuid.uuid4().hex[:8]}:"
    try:
        async with (
            hosted("tokenizer", TokenizerApp, env) as tok,
            hosted("inference", InferenceApp, env) as inf,
            hosted("cache", lambda s: CacheApp(s, key_prefix=prefix), env) as cache,
        ):
            gateway_env = {
                **env,
                "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
                "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                "LLMESH_RETRIEVAL_TARGET": f"127.0.0.1:{port}",
            }
            async with hosted("gateway", GatewayApp, gateway_env) as gw:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                    yield Mesh(gw, gateway_pb2_grpc.GatewayStub(channel), fake, inf)
    finally:
        await server.stop(grace=0.5)


def turn(role: str, content: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=role, content=content)


def conversation(earlier: str, question: str, **kw: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[turn("user", earlier), turn("assistant", "Noted."), turn("user", question)],
        sampling=common_pb2.SamplingParams(max_new_tokens=6),
        use_retrieval=False,
        **kw,  # type: ignore[arg-type]
    )


async def test_two_different_earlier_turns_never_share_an_entry_and_the_same_conversation_hits(mesh: Mesh) -> None:
    question = f"What is my name ({uuid.uuid4().hex[:6]})?"
    ann = conversation("My name is Ann.", question)
    bob = conversation("My name is Bob.", question)
    first = await mesh.stub.Generate(ann, timeout=60)
    assert not first.cache.hit
    await mesh.settle()
    # The same last question after another earlier turn: neither tier may answer it.
    other = await mesh.stub.Generate(bob, timeout=60)
    assert not other.cache.hit
    await mesh.settle()
    # Each conversation is its own entry, and asked again it hits exactly.
    again = await mesh.stub.Generate(ann, timeout=60)
    assert again.cache.hit and again.cache.tier == common_pb2.CACHE_TIER_EXACT and again.text == first.text
    assert (await mesh.stub.Generate(bob, timeout=60)).cache.tier == common_pb2.CACHE_TIER_EXACT
    # The question alone (no earlier turns) is another request again.
    alone = gateway_pb2.GenerateRequest(prompt=question, sampling=ann.sampling, use_retrieval=False)
    assert not (await mesh.stub.Generate(alone, timeout=60)).cache.hit


async def test_a_conversation_is_never_answered_by_the_semantic_tier(mesh: Mesh) -> None:
    tag = uuid.uuid4().hex[:6]
    asked = conversation("I live in Paris.", f"How far is the airport from here {tag}?")
    await mesh.stub.Generate(asked, timeout=60)
    await mesh.settle()
    # A near-duplicate last question after the same earlier turns: exact only, never semantic.
    near = conversation("I live in Paris.", f"How far is the airport from here {tag}")
    near.messages[-1].content = f"how far is the airport from here, {tag}?!"
    assert not (await mesh.stub.Generate(near, timeout=60)).cache.hit


async def test_retrieval_searches_with_the_last_user_turn_and_context_joins_the_system_turn(mesh: Mesh) -> None:
    question = f"How many vacation days do I get ({uuid.uuid4().hex[:6]})?"
    request = conversation("I joined in May.", question)
    request.use_retrieval = True
    request.use_cache = False
    reply = await mesh.stub.Generate(request, timeout=60)
    assert mesh.retrieval.queries[-1] == question
    assert [s.document_id for s in reply.sources] == ["handbook"]


async def test_the_openai_api_carries_every_turn_and_its_entries_follow_them(mesh: Mesh) -> None:
    question = f"And what did I say first ({uuid.uuid4().hex[:6]})?"
    async with openai.AsyncOpenAI(base_url=mesh.http_base, api_key="unused", max_retries=0, timeout=60) as client:

        async def chat(earlier: str) -> dict:
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": earlier},
                    {"role": "assistant", "content": "Sure."},
                    {"role": "user", "content": question},
                ],
                max_tokens=6,
                extra_body={"llmesh": {"use_retrieval": False}},
            )
            return answer.model_extra["llmesh"]  # type: ignore[index]

        assert not (await chat("Remember the word apple."))["cache"]["hit"]
        await mesh.settle()
        assert not (await chat("Remember the word pear."))["cache"]["hit"]
        await mesh.settle()
        assert (await chat("Remember the word apple."))["cache"]["tier"] == "exact"


async def test_a_bad_conversation_is_a_400_naming_the_field(mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=mesh.http_base, api_key="unused", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "r"}],
                max_tokens=4,
            )
    assert info.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]


def structured(question: str, form: common_pb2.ResponseFormat, max_new_tokens: int = 24) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=question,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
        use_retrieval=False,
        response_format=form,
    )


async def test_two_response_formats_never_share_an_entry_and_each_answer_has_its_form(mesh: Mesh) -> None:
    question = f"Describe a cat ({uuid.uuid4().hex[:6]})."
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    as_object = structured(question, common_pb2.ResponseFormat(type="json_object"))
    as_schema = structured(question, common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(schema)))
    first = await mesh.stub.Generate(as_object, timeout=60)
    assert not first.cache.hit and isinstance(json.loads(first.text), dict)
    await mesh.settle()
    second = await mesh.stub.Generate(as_schema, timeout=60)
    assert not second.cache.hit
    jsonschema.validate(json.loads(second.text), schema)
    await mesh.settle()
    # Free text, the same question: none of the structured entries answers it.
    free = await mesh.stub.Generate(structured(question, common_pb2.ResponseFormat()), timeout=60)
    assert not free.cache.hit
    await mesh.settle()
    for request, answer in ((as_object, first), (as_schema, second)):
        again = await mesh.stub.Generate(request, timeout=60)
        assert again.cache.tier == common_pb2.CACHE_TIER_EXACT and again.text == answer.text


async def test_a_structured_reply_cut_by_its_budget_still_validates(mesh: Mesh) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string"}, "n": {"type": "integer"}}}
    schema["required"] = ["story", "n"]
    form = common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(schema))
    request = structured("Tell a very long story.", form, max_new_tokens=12)
    request.sampling.temperature = 1.0
    request.sampling.seed = 5
    reply = await mesh.stub.Generate(request, timeout=60)
    jsonschema.validate(json.loads(reply.text), schema)
    assert reply.usage.output_tokens <= 12


async def test_bad_formats_are_refused_naming_the_field(mesh: Mesh) -> None:
    cases = [
        (common_pb2.ResponseFormat(type="json_schema", json_schema="{not json"), "response_format.json_schema"),
        (common_pb2.ResponseFormat(type="yaml"), "response_format.type"),
        (common_pb2.ResponseFormat(type="regex", regex="(unclosed"), "response_format.regex"),
    ]
    for form, field_name in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await mesh.stub.Generate(structured("Hi", form), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_name in (info.value.details() or "")
    # A schema whose shortest answer needs more than the budget: refused up front.
    keys = [f"k{i}" for i in range(12)]
    big = {"type": "object", "properties": {k: {"type": "string"} for k in keys}, "required": keys}
    form = common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(big))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await mesh.stub.Generate(structured("Hi", form, max_new_tokens=8), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_new_tokens" in (info.value.details() or "")


class Pet(BaseModel):
    # Bounded, so that even the tiny random model's value closes before max_tokens (a reply cut
    # by the budget closes too, but says "length", which the client refuses to parse).
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)
    kind: Literal["cat", "dog", "bird"]


async def test_the_openai_client_parses_a_pydantic_model(mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=mesh.http_base, api_key="unused", max_retries=0, timeout=60) as client:
        completion = await client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            max_tokens=40,
            extra_body={"llmesh": {"use_retrieval": False}},
        )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


async def test_a_named_tool_call_returns_tool_calls_whose_arguments_validate(mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=mesh.http_base, api_key="unused", max_retries=0, timeout=60) as client:
        named = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=40,
            extra_body={"llmesh": {"use_retrieval": False}},
        )
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[union-attr, index]
        # "required": one of the tools, chosen by the model, and the answer to it in a tool turn.
        required = await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
                {"role": "user", "content": "And the time?"},
            ],
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=40,
            extra_body={"llmesh": {"use_retrieval": False}},
        )
        (other,) = required.choices[0].message.tool_calls or []
        assert other.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
        assert isinstance(json.loads(other.function.arguments), dict)  # type: ignore[union-attr]
        # No tool_choice: "auto". Whatever the (random-weight) model chooses, a call it makes is
        # well formed: the grammar of text or calls holds it to an offered function's schema.
        auto = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            max_tokens=40,
            extra_body={"llmesh": {"use_retrieval": False}},
        )
        for made in auto.choices[0].message.tool_calls or []:
            assert made.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
            assert isinstance(json.loads(made.function.arguments), dict)  # type: ignore[union-attr]
        assert "<tool_call>" not in (auto.choices[0].message.content or "")


async def test_two_tool_lists_never_share_an_entry(mesh: Mesh) -> None:
    question = f"Weather please ({uuid.uuid4().hex[:6]})."
    weather = common_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER["function"]["parameters"]))  # type: ignore[index]
    clock = common_pb2.Tool(name="get_time")

    def ask(tools: list[common_pb2.Tool]) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            prompt=question,
            sampling=common_pb2.SamplingParams(max_new_tokens=40),
            use_retrieval=False,
            tools=tools,
            tool_choice=common_pb2.ToolChoice(mode="required"),
        )

    first = await mesh.stub.Generate(ask([weather]), timeout=60)
    assert not first.cache.hit and first.tool_calls[0].name == "get_weather"
    assert first.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    await mesh.settle()
    assert not (await mesh.stub.Generate(ask([weather, clock]), timeout=60)).cache.hit
    await mesh.settle()
    again = await mesh.stub.Generate(ask([weather]), timeout=60)
    assert again.cache.hit and [c.arguments for c in again.tool_calls] == [c.arguments for c in first.tool_calls]
    assert again.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS


async def test_a_non_streaming_client_that_disconnects_frees_its_row_and_its_weight(mesh: Mesh) -> None:
    engine = mesh.inference.app.manager.get().engine  # type: ignore[attr-defined]
    gateway = mesh.gateway.app.gateway  # type: ignore[attr-defined]
    gone = REGISTRY.get_sample_value("llmesh_gateway_http_disconnects_total") or 0.0
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write forever ({uuid.uuid4().hex[:6]})."}],
        "max_tokens": 1500,
        "temperature": 1.0,
        "llmesh": {"use_retrieval": False, "use_cache": False},
    }
    async with httpx.AsyncClient(timeout=60) as client:
        request = asyncio.create_task(client.post(f"{mesh.http_base}/chat/completions", json=body))
        await eventually(lambda: engine.running_count == 1, 20.0)
        request.cancel()  # the client goes away: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await request
    model = gateway.routes[""].learned[1]
    await eventually(lambda: engine.running_count == 0 and gateway.window.in_flight(model) == 0, 20.0)
    assert (REGISTRY.get_sample_value("llmesh_gateway_http_disconnects_total") or 0.0) == gone + 1
