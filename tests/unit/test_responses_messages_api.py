"""The Responses and Messages APIs' translation onto the gateway's chat request (turns, tools,
formats, sampling), their error shapes, and the stored-responses store; no servers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmesh.errors import InvalidArgument
from llmesh.testing import FakeClock
from llmesh.v1 import common_pb2
from services.gateway.messages_api import MessagesRequest, anthropic_error
from services.gateway.messages_api import renamed as messages_renamed
from services.gateway.response_store import MemoryResponses, StoredResponse
from services.gateway.responses_api import ResponseRequest, turn_dict, turn_of
from services.gateway.responses_api import renamed as responses_renamed
from services.gateway.shape import answer_shape

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def roles(turns: list[common_pb2.ChatMessage]) -> list[str]:
    return [t.role for t in turns]


def test_responses_input_items_become_the_conversation_in_order() -> None:
    body = ResponseRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather in "},
                        {"type": "input_text", "text": "Paris?"},
                    ],
                },
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "message", "role": "developer", "content": "Answer now."},
            ],
            "max_output_tokens": 12,
            "temperature": 0.5,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}},
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    earlier = [
        common_pb2.ChatMessage(role="user", content="Hi"),
        common_pb2.ChatMessage(role="assistant", content="Yo"),
    ]
    request, conversation = body.to_generate("acme", earlier)
    assert roles(list(request.messages)) == ["system", "user", "assistant", "user", "assistant", "tool", "system"]
    assert request.messages[0].content == "Be brief." and request.messages[3].content == "Weather in Paris?"
    calls = request.messages[4].tool_calls  # consecutive calls: one assistant turn
    assert [c.id for c in calls] == ["call_1", "call_2"] and calls[1].arguments == '{"city":"Lyon"}'
    assert request.messages[5].tool_call_id == "call_1" and request.messages[5].content == "sunny"
    # The instructions do not carry over to a next response: the conversation has none.
    assert roles(conversation) == roles(list(request.messages))[1:]
    assert request.sampling.max_new_tokens == 12 and request.sampling.temperature == 0.5
    assert request.response_format.type == "json_schema" and json.loads(request.response_format.json_schema) == SCHEMA
    assert request.tool_choice.mode == "function" and request.tool_choice.function == "get_weather"
    assert request.tenant == "acme" and request.model == "m"


def test_responses_shaping_fields_are_in_the_cache_shape() -> None:
    base = {"model": "m", "input": "Hi"}

    def shape(extra: dict) -> bytes:
        request, _ = ResponseRequest.model_validate({**base, **extra}).to_generate("t", [])
        return answer_shape(request, "")

    plain = shape({})
    assert shape({"instructions": "x"}) != plain
    assert shape({"text": {"format": {"type": "json_object"}}}) != plain
    assert shape({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}) != plain
    assert shape({"store": False}) == plain  # storing is not a shaping field


def test_responses_refuse_what_llmesh_does_not_do() -> None:
    for extra in (
        {"reasoning": {"effort": "low"}},
        {"tools": [{"type": "web_search"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"truncation": "auto"},
        {"background": True},
    ):
        with pytest.raises(ValidationError):
            ResponseRequest.model_validate({"model": "m", "input": "x", **extra})
    with pytest.raises(InvalidArgument) as refused:
        ResponseRequest.model_validate({"model": "m", "input": ""}).to_generate("t", [])
    assert refused.value.violations[0][0] == "input"
    gateway_says = InvalidArgument([("sampling.max_new_tokens", "too many"), ("response_format", "bad")])
    assert [f for f, _ in responses_renamed(gateway_says).violations] == ["max_output_tokens", "text.format"]


def test_messages_blocks_become_turns_and_tools() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 20,
            "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {"type": "text", "text": "And so?", "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ],
            "stop_sequences": ["END"],
            "top_k": 5,
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        }
    )
    request = body.to_generate("acme")
    assert roles(list(request.messages)) == ["system", "user", "assistant", "tool", "user"]
    assert request.messages[0].content == "Be terse.\nBe kind."
    assert request.messages[2].content == "Checking." and json.loads(request.messages[2].tool_calls[0].arguments) == {
        "city": "Paris"
    }
    assert request.messages[3].tool_call_id == "toolu_1" and request.messages[3].content == "sunny"
    assert list(request.sampling.stop) == ["END"] and request.sampling.top_k == 5
    assert request.sampling.max_new_tokens == 20
    assert json.loads(request.tools[0].parameters) == SCHEMA
    assert request.tool_choice.mode == "function" and request.tool_choice.function == "get_weather"


@pytest.mark.parametrize(("choice", "mode"), [("auto", "auto"), ("any", "required"), ("none", "none")])
def test_messages_tool_choice_maps_onto_the_gateway_modes(choice: str, mode: str) -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": choice},
        }
    )
    assert body.to_generate("t").tool_choice.mode == mode


def test_messages_refusals_name_the_field() -> None:
    with pytest.raises(ValidationError):  # max_tokens is required
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ValidationError):  # images are not served
        MessagesRequest.model_validate(
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            }
        )
    misplaced = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
        }
    )
    with pytest.raises(InvalidArgument) as refused:
        misplaced.to_generate("t")
    assert refused.value.violations[0][0] == "messages[0].content"
    gateway_says = InvalidArgument([("sampling.stop[0]", "too long"), ("tools[0].parameters", "not JSON")])
    assert [f for f, _ in messages_renamed(gateway_says).violations] == ["stop_sequences", "tools[0].input_schema"]
    body = {"error": {"message": "max_tokens: too many", "type": "invalid_request_error", "param": "max_tokens"}}
    assert anthropic_error(400, body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: too many"},
    }
    assert anthropic_error(503, body)["error"]["type"] == "overloaded_error"


async def test_memory_store_is_per_tenant_expires_and_is_bounded() -> None:
    clock = FakeClock()
    store = MemoryResponses(ttl_seconds=10, max_bytes=400, clock=clock)
    turn = common_pb2.ChatMessage(role="assistant", content="hi", tool_calls=[common_pb2.ToolCall(id="c", name="f")])
    record = StoredResponse({"id": "resp_1"}, [turn_dict(turn)])
    await store.put("acme", "resp_1", record)
    found = await store.get("acme", "resp_1")
    assert found is not None and turn_of(found.turns[0]) == turn
    assert await store.get("beta", "resp_1") is None and not await store.delete("beta", "resp_1")
    clock.advance(10)
    assert await store.get("acme", "resp_1") is None  # expired
    for i in range(5):  # each record ~130 bytes: the oldest go first
        await store.put("acme", f"resp_{i}", StoredResponse({"id": f"resp_{i}", "pad": "x" * 60}, []))
    assert await store.get("acme", "resp_0") is None and await store.get("acme", "resp_4") is not None
    assert store.size <= 400
    assert await store.delete("acme", "resp_4") and await store.get("acme", "resp_4") is None
