import math

import pytest

from llmesh.errors import InvalidArgument
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway.core import DEFAULT_SYSTEM_PROMPT, GatewayConfig, InputTokenPredictor, build_messages, validate

CONFIG = GatewayConfig(
    default_collection="docs",
    default_top_k=4,
    min_context_score=0.3,
    max_prompt_bytes=100,
    max_prompt_tokens=1000,
    max_new_tokens=256,
    default_max_new_tokens=64,
)


def test_defaults_are_filled() -> None:
    plan = validate(gateway_pb2.GenerateRequest(prompt="hi"), CONFIG)
    assert (plan.use_cache, plan.use_retrieval, plan.top_k, plan.collection, plan.tenant) == (
        True,
        True,
        4,
        "docs",
        "default",
    )
    assert plan.sampling.max_new_tokens == 64


def test_a_plan_is_frozen_plain_data() -> None:
    # What a plan hands out is a copy: changing it changes no plan. Equal asks are equal plans
    # (hashable), and a narrower plan is derived, the asked one left as it was.
    request = gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(role="user", content="hi"),
            common_pb2.ChatMessage(role="assistant", content="yo"),
            common_pb2.ChatMessage(role="user", content="again"),
        ],
        sampling=common_pb2.SamplingParams(temperature=0.5, logit_bias={7: 1.0, 3: -1.0}),
    )
    plan = validate(request, CONFIG)
    plan.sampling.max_new_tokens = 1
    plan.turns[0].content = "changed"
    assert plan.sampling.max_new_tokens == 64 and plan.turns[0].content == "hi"
    assert plan == validate(request, CONFIG) and hash(plan) == hash(validate(request, CONFIG))
    capped = plan.with_max_new_tokens(8).without_retrieval().for_model("other")
    assert (capped.sampling.max_new_tokens, capped.use_retrieval, capped.model) == (8, False, "other")
    assert (plan.sampling.max_new_tokens, plan.use_retrieval, plan.model) == (64, True, "")


def test_explicit_false_is_honoured() -> None:
    plan = validate(gateway_pb2.GenerateRequest(prompt="hi", use_cache=False, use_retrieval=False), CONFIG)
    assert not plan.use_cache and not plan.use_retrieval


def test_greedy_requests_share_one_cache_scope() -> None:
    a = validate(
        gateway_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(top_p=0.5, seed=3)), CONFIG
    )
    b = validate(gateway_pb2.GenerateRequest(prompt="hi"), CONFIG)
    assert a.sampling == b.sampling


def test_every_bad_field_is_reported() -> None:
    request = gateway_pb2.GenerateRequest(
        prompt=" ",
        top_k=99,
        tenant="bad tenant!",
        sampling=common_pb2.SamplingParams(
            max_new_tokens=10_000, temperature=math.nan, top_p=1.5, stop=["", "a", "b", "c", "d"]
        ),
    )
    with pytest.raises(InvalidArgument) as info:
        validate(request, CONFIG)
    fields = {f for f, _ in info.value.violations}
    assert fields >= {
        "prompt",
        "top_k",
        "tenant",
        "sampling.max_new_tokens",
        "sampling.temperature",
        "sampling.top_p",
        "sampling.stop",
        "sampling.stop[0]",
    }


def test_oversize_prompt_is_refused_by_bytes() -> None:
    with pytest.raises(InvalidArgument, match="longer than 100 bytes"):
        validate(gateway_pb2.GenerateRequest(prompt="é" * 51), CONFIG)


def test_context_goes_into_the_system_message() -> None:
    plan = validate(gateway_pb2.GenerateRequest(prompt="Who is Zorblax?"), CONFIG)
    sources = [common_pb2.ScoredChunk(document_id="d1", text="Zorblax is a teapot.", score=0.9)]
    messages = build_messages(plan, sources)
    assert [m.role for m in messages] == ["system", "user"]
    assert "[1] Zorblax is a teapot." in messages[0].content
    assert messages[1].content == "Who is Zorblax?"


def test_input_token_prediction_learns_tokens_per_byte_and_context_per_collection() -> None:
    predictor = InputTokenPredictor()
    plain = validate(gateway_pb2.GenerateRequest(prompt="x" * 80, use_retrieval=False), CONFIG)
    rag = validate(gateway_pb2.GenerateRequest(prompt="x" * 80, collection="handbook"), CONFIG)
    size = InputTokenPredictor.text_bytes(plain)
    assert predictor.predict(plain) == predictor.predict(rag) == size // 8  # nothing seen yet: the bound
    predictor.observe(plain, size // 4)  # this tokenizer: 4 bytes a token
    assert predictor.predict(plain) == size // 4
    assert predictor.predict(rag) == size // 4  # no context seen for this collection yet
    predictor.observe(rag, size // 4 + 300, context_bytes=1500)
    assert predictor.predict(rag) == size // 4 + 300
    other = validate(gateway_pb2.GenerateRequest(prompt="x" * 80, collection="other"), CONFIG)
    assert predictor.predict(other) == size // 4  # context is learned per collection
    for _ in range(60):
        predictor.observe(plain, size // 100)  # learns, but never predicts below bytes / 8
    assert predictor.predict(plain) == size // 8


def test_the_local_estimate_uses_the_context_rate_not_the_short_questions_rate() -> None:
    # A short question's rate carries the chat template's tokens (here 0.5 a byte); retrieved
    # context is plain prose (0.2 a byte). Rendered bytes x the question's rate would overstate
    # a RAG prompt about twofold, enough to refuse a request after its hops.
    predictor = InputTokenPredictor()
    plan = validate(gateway_pb2.GenerateRequest(prompt="x" * 80, collection="handbook"), CONFIG)
    size = InputTokenPredictor.text_bytes(plan)
    rendered = "y" * 3000
    assert predictor.estimate(plan, 2000, rendered) == 1000  # nothing learned: 3 bytes a token
    predictor.observe(plan, size // 2)
    predictor.observe(plan, size // 2 + 400, context_bytes=2000)
    exact = size // 2 + 400
    estimate = predictor.estimate(plan, 2000, rendered)
    assert exact <= estimate <= 1.15 * exact
    assert estimate < 0.6 * (size + 2000) * 0.5  # the question's rate over every byte: far more


def turn(role: str, content: str = "", **kw: object) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=role, content=content, **kw)  # type: ignore[arg-type]


def test_a_conversation_keeps_its_turns_and_its_question_is_the_last_user_turn() -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[
            turn("system", "Be brief."),
            turn("user", "My name is Ann."),
            turn("assistant", "Hello Ann."),
            turn("user", "What is my name?"),
        ]
    )
    plan = validate(request, CONFIG)
    assert plan.prompt == "What is my name?" and not plan.semantic
    sources = [common_pb2.ScoredChunk(document_id="d1", text="Ann is a pilot.", score=0.9)]
    messages = build_messages(plan, sources)
    assert [(m.role, m.content.split("\n")[0]) for m in messages] == [
        ("system", "Be brief."),
        ("user", "My name is Ann."),
        ("assistant", "Hello Ann."),
        ("user", "What is my name?"),
    ]
    # The one rule: context joins the system turn.
    assert "[1] Ann is a pilot." in messages[0].content and "pilot" not in messages[-1].content


def test_a_conversation_without_a_system_turn_gets_the_default_one() -> None:
    plan = validate(
        gateway_pb2.GenerateRequest(messages=[turn("user", "a"), turn("assistant", "b"), turn("user", "c")]), CONFIG
    )
    messages = build_messages(plan, [])
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0].content == DEFAULT_SYSTEM_PROMPT


def test_a_question_as_one_turn_is_the_shorthand_and_may_be_answered_semantically() -> None:
    as_turns = validate(gateway_pb2.GenerateRequest(messages=[turn("system", "S."), turn("user", "Q?")]), CONFIG)
    shorthand = validate(gateway_pb2.GenerateRequest(prompt="Q?", system_prompt="S."), CONFIG)
    assert as_turns.semantic and not as_turns.turns
    assert (as_turns.prompt, as_turns.system_prompt, as_turns.shape) == ("Q?", "S.", shorthand.shape)


@pytest.mark.parametrize(
    ("messages", "extra", "fields"),
    [
        ([turn("user", "a"), turn("assistant", "b")], {}, {"messages"}),
        ([turn("assistant", "b")], {}, {"messages"}),
        ([turn("robot", "a"), turn("user", "q")], {}, {"messages[0].role"}),
        ([turn("user", "a"), turn("tool", "r", tool_call_id="x")], {}, {"messages[1].tool_call_id"}),
        ([turn("user", "q")], {"prompt": "q"}, {"prompt"}),
        ([turn("user", "a"), turn("user", "q")], {"system_prompt": "s"}, {"system_prompt"}),
        ([turn("user", " "), turn("assistant", "b"), turn("user", "q")], {}, {"messages[0].content"}),
        (
            [turn("user", "q", tool_calls=[common_pb2.ToolCall(id="1", name="f")]), turn("user", "q")],
            {},
            {"messages[0].tool_calls"},
        ),
    ],
)
def test_bad_conversations_are_refused_naming_the_field(
    messages: list[common_pb2.ChatMessage], extra: dict[str, str], fields: set[str]
) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate(gateway_pb2.GenerateRequest(messages=messages, **extra), CONFIG)  # type: ignore[arg-type]
    assert {f for f, _ in info.value.violations} == fields


def test_a_tool_turn_answering_an_earlier_call_is_accepted() -> None:
    call = common_pb2.ToolCall(id="call_1", name="weather", arguments='{"city": "Paris"}')
    plan = validate(
        gateway_pb2.GenerateRequest(
            messages=[
                turn("user", "Weather in Paris?"),
                turn("assistant", "", tool_calls=[call]),
                turn("tool", "18C", tool_call_id="call_1"),
            ]
        ),
        CONFIG,
    )
    assert plan.prompt == "Weather in Paris?" and len(plan.turns) == 3


def test_n_and_logprobs_are_checked_and_never_use_the_cache() -> None:
    plain = validate(gateway_pb2.GenerateRequest(prompt="hi", n=1), CONFIG)
    assert plain.n == 1 and plain.use_cache
    many = validate(gateway_pb2.GenerateRequest(prompt="hi", n=16), CONFIG)
    assert many.n == 16 and not many.use_cache
    scored = validate(
        gateway_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(logprobs=True, top_logprobs=20)),
        CONFIG,
    )
    assert not scored.use_cache and scored.sampling.top_logprobs == 20
    with pytest.raises(InvalidArgument) as bad:
        validate(
            gateway_pb2.GenerateRequest(prompt="hi", n=17, sampling=common_pb2.SamplingParams(top_logprobs=2)), CONFIG
        )
    assert [f for f, _ in bad.value.violations] == ["sampling.top_logprobs", "n"]
    with pytest.raises(InvalidArgument) as bad:
        validate(
            gateway_pb2.GenerateRequest(
                prompt="hi", sampling=common_pb2.SamplingParams(logprobs=True, top_logprobs=21)
            ),
            CONFIG,
        )
    assert [f for f, _ in bad.value.violations] == ["sampling.top_logprobs"]


def test_a_raw_completion_has_no_template_parts_and_no_context_unless_asked() -> None:
    plan = validate(gateway_pb2.GenerateRequest(prompt="Once upon a time", raw=True), CONFIG)
    assert plan.raw and not plan.use_retrieval and not plan.semantic and plan.use_cache
    assert plan.text_bytes() == len("Once upon a time")  # no default system prompt weighed
    asked = validate(gateway_pb2.GenerateRequest(prompt="Once", raw=True, use_retrieval=True), CONFIG)
    assert asked.use_retrieval
    ids = validate(gateway_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], raw=True), CONFIG)
    assert ids.prompt_token_ids == (5, 6, 7) and not ids.use_cache  # no text to key an answer on
    templated = validate(gateway_pb2.GenerateRequest(prompt="Once upon a time"), CONFIG)
    assert templated.shape != plan.shape  # the raw and the templated answer never share an entry
    # The exact key normalizes a question's surrounding whitespace and final mark; a raw text's
    # continuation depends on them, so its shape holds the exact text.
    spaced = validate(gateway_pb2.GenerateRequest(prompt="Once upon a time. ", raw=True), CONFIG)
    assert spaced.shape != plan.shape
    bad = [
        (gateway_pb2.GenerateRequest(prompt_token_ids=[5]), {"prompt_token_ids", "prompt"}),
        (gateway_pb2.GenerateRequest(prompt="a", system_prompt="b", raw=True), {"system_prompt"}),
        (
            gateway_pb2.GenerateRequest(raw=True, messages=[common_pb2.ChatMessage(role="user", content="a")]),
            {"messages", "prompt"},
        ),
        (gateway_pb2.GenerateRequest(raw=True, prompt="a", prompt_token_ids=[5]), {"prompt_token_ids"}),
        (gateway_pb2.GenerateRequest(raw=True, prompt_token_ids=[5], use_retrieval=True), {"use_retrieval"}),
        (gateway_pb2.GenerateRequest(raw=True), {"prompt"}),
    ]
    for request, fields in bad:
        with pytest.raises(InvalidArgument) as info:
            validate(request, CONFIG)
        assert {f for f, _ in info.value.violations} == fields, request


def test_prompt_scoring_and_min_tokens_are_checked_and_never_cached() -> None:
    scored = validate(
        gateway_pb2.GenerateRequest(prompt="a", raw=True, sampling=common_pb2.SamplingParams(prompt_logprobs=0)), CONFIG
    )
    assert not scored.use_cache
    read = validate(
        gateway_pb2.GenerateRequest(prompt="a", raw=True, sampling=common_pb2.SamplingParams(prompt_only=True)), CONFIG
    )
    assert not read.use_cache and read.sampling.max_new_tokens == 1  # one token's weight in admission
    for sampling, field in (
        (common_pb2.SamplingParams(prompt_logprobs=21), "sampling.prompt_logprobs"),
        (common_pb2.SamplingParams(max_new_tokens=4, min_new_tokens=5), "sampling.min_new_tokens"),
    ):
        with pytest.raises(InvalidArgument) as info:
            validate(gateway_pb2.GenerateRequest(prompt="a", sampling=sampling), CONFIG)
        assert [f for f, _ in info.value.violations] == [field]
