"""OpenAI request bodies -> the gateway's GenerateRequest, and what is refused before the pipeline."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmesh.errors import InvalidArgument
from services.gateway.core import one_turn_form
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, param_name


def chat(**body: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **body})


def test_one_user_message_is_the_prompt_as_a_grpc_caller_sends_it() -> None:
    request = chat(messages=[{"role": "user", "content": "What is 2 plus 2?"}]).to_generate("acme")
    assert [(t.role, t.content) for t in request.messages] == [("user", "What is 2 plus 2?")]
    assert request.tenant == "acme"
    # The gateway writes a conversation that is only a question as the one-turn shorthand.
    shorthand = one_turn_form(request)
    assert shorthand.prompt == "What is 2 plus 2?" and shorthand.system_prompt == "" and not shorthand.messages
    # Omitted sampling is greedy, as in the gRPC API (and so shares its cache entries).
    assert request.sampling.temperature == 0 and request.sampling.max_new_tokens == 0
    assert not request.HasField("use_cache") and not request.HasField("use_retrieval")


def test_system_messages_history_parts_and_extension() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use French."}]},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
        ],
        max_tokens=8,
        max_completion_tokens=16,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop="END",
        llmesh={"collection": "docs", "use_cache": False, "use_retrieval": True, "top_k": 3, "lane": "batch"},
    ).to_generate("default")
    # Every message is a turn of its own, in order: nothing is folded into another.
    assert not request.prompt and not request.system_prompt
    assert [(t.role, t.content) for t in request.messages] == [
        ("system", "Be brief."),
        ("system", "Use French."),
        ("user", "Hi"),
        ("assistant", "Bonjour"),
        ("user", "How are you?"),
    ]
    s = request.sampling
    assert (s.max_new_tokens, round(s.temperature, 3), round(s.top_p, 3), s.seed, list(s.stop)) == (
        16,
        0.5,
        0.9,
        7,
        ["END"],
    )
    assert (request.collection, request.use_cache, request.use_retrieval, request.top_k, request.lane) == (
        "docs",
        False,
        True,
        3,
        "batch",
    )


def test_completion_prompt_string_or_one_item_list() -> None:
    body = {"model": "m", "max_tokens": 5}
    for prompt in ("Say hi", ["Say hi"]):
        request = CompletionRequest.model_validate({**body, "prompt": prompt}).to_generate("default")
        assert request.prompt == "Say hi" and request.sampling.max_new_tokens == 5


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"n": 3, "logprobs": True, "functions": [{}], "audio": {}}, {"functions", "audio"}),
        ({"logit_bias": {"one": 2}, "n": 2}, {"logit_bias"}),
        ({"stream_options": {"include_usage": True}}, {"stream_options"}),
    ],
)
def test_unsupported_parameters_are_named_not_ignored(body: dict, fields: set[str]) -> None:
    with pytest.raises(InvalidArgument) as info:
        chat(**{"messages": [{"role": "user", "content": "a"}], **body}).to_generate("default")
    assert {f for f, _ in info.value.violations} == fields


def test_defaults_of_unsupported_parameters_are_accepted() -> None:
    request = chat(
        messages=[{"role": "user", "content": "a"}],
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        stream=True,
        stream_options={"include_usage": True},
        response_format={"type": "text"},
        user="someone",
    )
    assert request.include_usage and request.to_generate("default").messages[0].content == "a"
    with pytest.raises(InvalidArgument):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).to_generate("default")


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "a"}], "unknown_field": 1},
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "a"}], "llmesh": {"colection": "typo"}},
    ],
)
def test_shapes_and_types_are_refused_by_the_model(body: dict) -> None:
    with pytest.raises(ValidationError):
        chat(**body)


def test_gateway_field_paths_map_to_api_parameters() -> None:
    assert param_name("sampling.temperature", "messages") == "temperature"
    assert param_name("sampling.stop[1]", "messages") == "stop"
    assert param_name("prompt", "messages") == "messages"
    assert param_name("prompt", "prompt") == "prompt"
    assert param_name("collection", "prompt") == "llmesh.collection"


def test_tool_turns_and_calls_are_carried_as_they_are() -> None:
    request = chat(
        messages=[
            {"role": "user", "content": "Weather in Paris?", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        ]
    ).to_generate("default")
    user, assistant, tool = request.messages
    assert (user.role, user.name) == ("user", "ann")
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "weather", '{"city":"Paris"}')]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "18C, sunny")


def test_response_formats_map_onto_the_contract() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(
        messages=[{"role": "user", "content": "a"}],
        response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}},
    ).to_generate("default")
    form = request.response_format
    assert (form.type, form.name, form.strict, json.loads(form.json_schema)) == ("json_schema", "A", True, schema)
    as_object = chat(messages=[{"role": "user", "content": "a"}], response_format={"type": "json_object"})
    assert as_object.to_generate("default").response_format.type == "json_object"
    choice = chat(messages=[{"role": "user", "content": "a"}], response_format={"type": "choice", "choices": ["x"]})
    assert list(choice.to_generate("default").response_format.choices) == ["x"]
    text = chat(messages=[{"role": "user", "content": "a"}], response_format={"type": "text"})
    assert not text.to_generate("default").HasField("response_format")


def test_every_sampling_field_maps_onto_the_contract() -> None:
    s = (
        chat(
            messages=[{"role": "user", "content": "a"}],
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logit_bias={"17": 3.0},
            top_k=40,
            min_p=0.1,
            repetition_penalty=1.2,
            stop_token_ids=[7, 9],
        )
        .to_generate("default")
        .sampling
    )
    assert (s.top_k, round(s.min_p, 3), round(s.repetition_penalty, 3)) == (40, 0.1, 1.2)
    assert (s.presence_penalty, s.frequency_penalty, dict(s.logit_bias), list(s.stop_token_ids)) == (
        0.5,
        -0.5,
        {17: 3.0},
        [7, 9],
    )


def test_n_and_logprobs_map_onto_the_request() -> None:
    request = chat(messages=[{"role": "user", "content": "a"}], n=3, logprobs=True, top_logprobs=5).to_generate("t")
    assert request.n == 3 and request.sampling.logprobs and request.sampling.top_logprobs == 5
    plain = chat(messages=[{"role": "user", "content": "a"}]).to_generate("t")
    assert plain.n == 0 and not plain.sampling.logprobs and plain.sampling.top_logprobs == 0
    legacy = CompletionRequest.model_validate({"model": "m", "prompt": "a", "logprobs": 2, "n": 2}).to_generate("t")
    assert legacy.n == 2 and legacy.sampling.logprobs and legacy.sampling.top_logprobs == 2
    zero = CompletionRequest.model_validate({"model": "m", "prompt": "a", "logprobs": 0}).to_generate("t")
    assert zero.sampling.logprobs and zero.sampling.top_logprobs == 0


def test_embedding_inputs_as_text_only() -> None:
    one = EmbeddingRequest.model_validate({"model": "e", "input": "hello"}).to_embed("t")
    assert list(one.inputs) == ["hello"] and one.model == "e" and one.tenant == "t"
    many = EmbeddingRequest.model_validate({"model": "e", "input": ["a", "b"], "encoding_format": "base64"})
    assert list(many.to_embed("t").inputs) == ["a", "b"]
    for tokens in ([1, 2, 3], [[1, 2], [3]]):
        with pytest.raises(InvalidArgument) as info:
            EmbeddingRequest.model_validate({"model": "e", "input": tokens}).to_embed("t")
        assert [f for f, _ in info.value.violations] == ["input"]
    with pytest.raises(InvalidArgument) as info:
        EmbeddingRequest.model_validate(
            {"model": "e", "input": "a", "dimensions": 8, "llmesh": {"collection": "docs"}}
        ).to_embed("t")
    assert [f for f, _ in info.value.violations] == ["dimensions", "llmesh.collection"]
    assert param_name("inputs[3]", "input") == "input"
    assert param_name("sampling.top_logprobs", "prompt") == "logprobs"
    assert param_name("sampling.top_logprobs", "messages") == "top_logprobs"
