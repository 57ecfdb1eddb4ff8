"""OpenAI request bodies -> the gateway's GenerateRequest, and what is refused before the pipeline."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmesh.errors import InvalidArgument
from llmesh.v1 import common_pb2, gateway_pb2
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
    batch = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "stream": True})
    assert batch.prompts() == ["a", "b"]
    with pytest.raises(InvalidArgument):  # a batch is answered whole
        batch.to_generate("default")


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


def test_a_completion_is_raw_text_or_token_ids_and_echo_scores_the_prompt() -> None:
    def completion(**body: object) -> gateway_pb2.GenerateRequest:
        return CompletionRequest.model_validate({"model": "m", **body}).to_generate("t")

    text = completion(prompt="Once upon a time")
    assert text.raw and text.prompt == "Once upon a time" and not text.messages and not text.system_prompt
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        ids = completion(prompt=prompt)
        assert ids.raw and ids.prompt == "" and list(ids.prompt_token_ids) == [5, 6, 7]
    scoring = completion(prompt="a b c", echo=True, logprobs=3, max_tokens=0)
    s = scoring.sampling
    assert s.prompt_only and s.HasField("prompt_logprobs") and s.prompt_logprobs == 3 and not s.logprobs
    echoed_ids = completion(prompt=[5, 6], echo=True, max_tokens=4)  # the prompt's text comes from its scores
    assert echoed_ids.sampling.HasField("prompt_logprobs") and not echoed_ids.sampling.prompt_only
    assert not completion(prompt="a", echo=True).sampling.HasField("prompt_logprobs")
    with pytest.raises(InvalidArgument) as info:
        completion(prompt="def f(", suffix="return x")
    assert [f for f, _ in info.value.violations] == ["suffix"]
    with pytest.raises(InvalidArgument) as info:
        completion(prompt="a", echo=True, logprobs=1, stream=True)
    assert [f for f, _ in info.value.violations] == ["echo"]


def test_vllms_fields_map_onto_the_contract_for_chat_and_completions() -> None:
    fields = {
        "ignore_eos": True,
        "min_tokens": 3,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "prompt_logprobs": 2,
    }
    for request in (
        chat(messages=[{"role": "user", "content": "a"}], **fields).to_generate("t"),
        CompletionRequest.model_validate({"model": "m", "prompt": "a", **fields}).to_generate("t"),
    ):
        s = request.sampling
        assert (s.ignore_eos, s.min_new_tokens, s.keep_special_tokens, s.include_stop_str) == (True, 3, True, True)
        assert s.prompt_logprobs == 2
    plain = chat(messages=[{"role": "user", "content": "a"}]).to_generate("t").sampling
    assert not plain.keep_special_tokens and not plain.HasField("prompt_logprobs")


@pytest.mark.parametrize(
    ("fields", "form"),
    [
        (
            {"guided_json": {"type": "object"}},
            common_pb2.ResponseFormat(type="json_schema", json_schema='{"type":"object"}'),
        ),
        (
            {"structured_outputs": {"json": '{"type":"object"}'}},
            common_pb2.ResponseFormat(type="json_schema", json_schema='{"type":"object"}'),
        ),
        ({"guided_regex": "[0-9]+"}, common_pb2.ResponseFormat(type="regex", regex="[0-9]+")),
        ({"structured_outputs": {"regex": "[0-9]+"}}, common_pb2.ResponseFormat(type="regex", regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, common_pb2.ResponseFormat(type="choice", choices=["a", "b"])),
        ({"structured_outputs": {"choice": ["a", "b"]}}, common_pb2.ResponseFormat(type="choice", choices=["a", "b"])),
        ({"structured_outputs": {"json_object": True}}, common_pb2.ResponseFormat(type="json_object")),
    ],
)
def test_vllms_structured_output_fields_are_llmesh_response_formats(
    fields: dict, form: common_pb2.ResponseFormat
) -> None:
    assert chat(messages=[{"role": "user", "content": "a"}], **fields).to_generate("t").response_format == form
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "a", **fields}).to_generate("t")
    assert completion.response_format == form


def test_two_constraints_or_an_unsupported_one_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as info:
        chat(messages=[{"role": "user", "content": "a"}], guided_regex="x", guided_choice=["y"]).to_generate("t")
    assert [f for f, _ in info.value.violations] == ["guided_choice"]
    with pytest.raises(InvalidArgument) as info:
        chat(messages=[{"role": "user", "content": "a"}], guided_grammar="root ::= x").to_generate("t")
    assert [f for f, _ in info.value.violations] == ["guided_grammar"]
    with pytest.raises(InvalidArgument) as info:
        chat(
            messages=[{"role": "user", "content": "a"}], guided_regex="x", response_format={"type": "json_object"}
        ).to_generate("t")
    assert [f for f, _ in info.value.violations] == ["response_format"]
