"""Automatic tool choice on SmolLM2 through the real mesh (tokenizer, the builtin engine, gateway,
OpenAI-compatible HTTP), with real clients: a LangChain agent with two tools and the default tool
choice, the openai SDK's stream reassembled into the same calls as the whole answer, and
tool_choice "none" / named / "required" beside "auto".

SmolLM2's template shows no tools: the gateway's Hermes preamble shows them, and the answer is
decoded under the grammar of text or calls, so every call the model makes is valid JSON naming an
offered function. Whether it calls stays the model's choice; the tasks here are ones it calls for
at temperature 0."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from llmesh.server import ServiceHost
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

CLOSED = "127.0.0.1:1"
FOLDER, MODEL = "smollm2", "SmolLM2-135M-Instruct"
NO_RAG = {"llmesh": {"use_retrieval": False, "use_cache": False}}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER_PARAMS},
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current local time in a city.", "parameters": TIME_PARAMS},
}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
SYSTEM = "You are a weather assistant. To answer a question about the weather, first call get_weather."
QUESTION = "What is the weather in Paris?"
# An earlier exchange in the conversation that shows the tool in use (a 135M model follows an
# example far better than an instruction): a call, its result as a tool turn, the answer.
EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "Cloudy and 15 C in Rome."},
    {"role": "assistant", "content": "It is cloudy and 15 C in Rome."},
]
MESSAGES = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": QUESTION}]


@dataclass
class Mesh:
    gateway: ServiceHost

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.app.http.port}/v1"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def mesh(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("tools")),
        "LLMESH_INFERENCE_MODEL": FOLDER,
        "LLMESH_TOKENIZER_MODEL": FOLDER,
    }
    async with hosted("tokenizer", TokenizerApp, env) as tok, hosted("inference", InferenceApp, env) as inf:
        gateway_env = {
            **env,
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
            "LLMESH_ADMISSION_ADAPTIVE": "false",
            "LLMESH_DEFAULT_DEADLINE_SECONDS": "600",  # two shared cores: a slow answer is no failure
        }
        async with hosted("gateway", GatewayApp, gateway_env) as gw:
            yield Mesh(gw)


def client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.http_base, api_key="unused", max_retries=0, timeout=300)


def check_call(name: str, arguments: str) -> dict[str, Any]:
    """A call is well formed: it names an offered function and its arguments validate."""
    assert name in SCHEMAS, name
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


async def test_a_langchain_agent_with_two_tools_and_the_default_choice_completes(mesh: Mesh) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    asked: list[tuple[str, str]] = []

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(("get_weather", city))
        return f"Sunny and 21 C in {city}."

    @tool
    def get_time(city: str) -> str:
        """The current local time in a city."""
        asked.append(("get_time", city))
        return f"It is 14:05 in {city}."

    sent: list[dict[str, Any]] = []

    async def record(request: Any) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    import httpx

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=300)
    model = ChatOpenAI(
        model=MODEL,
        base_url=mesh.http_base,
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=64,
        max_retries=0,
        http_async_client=http,
        extra_body=NO_RAG,
    )
    agent = create_agent(model, tools=[get_weather, get_time], system_prompt=SYSTEM)
    given = [*EXAMPLE, {"role": "user", "content": QUESTION}]
    result = await agent.ainvoke({"messages": given}, {"recursion_limit": 8})
    await http.aclose()
    messages = result["messages"][len(given) :]  # what the agent added
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls, [m.content for m in messages]  # the model chose to call...
    for call in calls:  # ...and every call is well formed, naming an offered function
        check_call(call["name"], json.dumps(call["args"]))
    assert asked and all(city for _, city in asked)
    # Each tool result went back as a `tool` turn naming its call, and the agent ended on text.
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert {r.tool_call_id for r in results} == {c["id"] for c in calls}
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls and messages[-1].content
    assert len(sent) >= 2 and all("tool_choice" not in body and body["tools"] for body in sent)  # default: auto
    ids = {c["id"] for c in calls}
    last = sent[-1]["messages"]
    assert {m["tool_call_id"] for m in last if m["role"] == "tool"} >= ids
    assert any(m["role"] == "assistant" and {c["id"] for c in m.get("tool_calls") or ()} & ids for m in last)


async def test_a_streamed_answer_reassembles_into_the_same_calls(mesh: Mesh) -> None:
    messages = MESSAGES
    async with client(mesh) as api:
        whole = await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER, TIME],
            max_tokens=64,
            extra_body=NO_RAG,  # type: ignore[arg-type]
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # type: ignore[union-attr]
        for name, arguments in expected:
            check_call(name, arguments)
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            max_tokens=64,
            stream=True,
            extra_body=NO_RAG,
        )
        calls: dict[int, dict[str, str]] = {}
        text, finish = "", None
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for piece in delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                if piece.id:
                    assert not call["id"] and piece.type == "function"  # the id comes once, first
                    call["id"] = piece.id
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in text
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())


async def test_auto_over_grpc_answers_with_tool_calls(mesh: Mesh) -> None:
    turns = [
        common_pb2.ChatMessage(
            role=m["role"],
            content=m["content"] or "",
            tool_call_id=m.get("tool_call_id", ""),
            tool_calls=[
                common_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                for c in m.get("tool_calls") or ()
            ],
        )
        for m in MESSAGES
    ]
    tools = [
        common_pb2.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"]))
        for t in (WEATHER, TIME)
    ]  # type: ignore[index]
    request = gateway_pb2.GenerateRequest(
        messages=turns,
        tools=tools,
        sampling=common_pb2.SamplingParams(max_new_tokens=64),
        use_retrieval=False,
        use_cache=False,
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.gateway.port}") as channel:
        answer = await gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=600)
    assert answer.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS and not answer.text
    assert answer.tool_calls and all(c.id.startswith("call_") for c in answer.tool_calls)
    for call in answer.tool_calls:
        check_call(call.name, call.arguments)


async def test_none_gives_text_and_named_and_required_still_call(mesh: Mesh) -> None:
    messages = MESSAGES
    async with client(mesh) as api:
        none = await api.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="none",
            max_tokens=32,
            extra_body=NO_RAG,
        )
        assert not none.choices[0].message.tool_calls and none.choices[0].message.content
        assert none.choices[0].finish_reason != "tool_calls"
        named = await api.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=32,
            extra_body=NO_RAG,
        )
        (call,) = named.choices[0].message.tool_calls or []
        assert call.function.name == "get_time"  # type: ignore[union-attr]
        check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
        required = await api.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=32,
            extra_body=NO_RAG,
        )
        (call,) = required.choices[0].message.tool_calls or []
        check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
