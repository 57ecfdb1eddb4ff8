"""The tool-call formats of the model families (hermes, llama3, mistral) on answers as those models
write them: single and parallel calls, text around calls, and malformed calls, which stay text and
never raise. Also what streams (`CallStream`), the preamble turns of a template that shows no tools,
and the grammar that keeps an automatic call valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from llmesh import tool_calls
from llmesh.chat_template import ChatTemplate
from llmesh.v1 import common_pb2

NAMES = {"get_weather", "get_time"}
WEATHER = common_pb2.Tool(
    name="get_weather",
    description="The weather in a city.",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
TIME = common_pb2.Tool(name="get_time", description="The time now.")


def calls(text: str, fmt: str) -> tuple[str, list[tuple[str, dict]]]:
    content, found = tool_calls.parse(text, fmt, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


def test_hermes_single_parallel_and_text_before() -> None:
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert calls(one, "hermes") == ("", [("get_weather", {"city": "Paris"})])
    # Qwen 2.5 writes parallel calls as consecutive blocks, often with text before them.
    two = (
        "Let me look that up.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert calls(two, "hermes") == (
        "Let me look that up.\n",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    )
    # Arguments given as a JSON string (some fine-tunes do) are the same call.
    as_string = '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    assert calls(as_string, "hermes") == ("", [("get_time", {})])


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off mid-call
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not offered
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',  # not an object
        "",
    ],
)
def test_hermes_malformed_answers_stay_text(text: str) -> None:
    assert calls(text, "hermes") == (text, [])


def test_llama3_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls(one, "llama3") == ("", [("get_weather", {"city": "Paris"})])
    tagged = '<|python_tag|>{"name": "get_time", "parameters": {}}'
    assert calls(tagged, "llama3") == ("", [("get_time", {})])
    parallel = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert calls(parallel, "llama3") == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    for text in (
        "It is sunny in Paris.",
        '{"city": "Paris"}',  # JSON, but no call
        '{"name": "get_weather", "parameters": {"city": "Paris"}',  # unclosed
        '{"name": "get_weather", "parameters": {}} and then some text',
        '{"name": "nope", "parameters": {}}',
    ):
        assert calls(text, "llama3") == (text, [])


def test_mistral_calls_in_both_tokenizer_versions() -> None:
    v3 = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    assert calls(v3, "mistral") == ("", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    assert calls(v11, "mistral") == ("", [("get_weather", {"city": "Rome"}), ("get_time", {})])
    before = 'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    assert calls(before, "mistral") == ("Checking. ", [("get_time", {})])
    for text in ("Plain answer.", '[TOOL_CALLS] [{"name": "get_weather", ', '[TOOL_CALLS]nope[ARGS]{"a": 1}'):
        assert calls(text, "mistral") == (text, [])


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (
            "hermes",
            'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        ("hermes", "No call <tool_ here, just text with a < sign."),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
        ("mistral", 'Ok [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
        ("mistral", "Nothing to call."),
    ],
)
def test_streamed_pieces_give_the_same_text_and_calls(fmt: str, text: str) -> None:
    whole_text, whole_calls = tool_calls.parse(text, fmt, NAMES)
    stream = tool_calls.CallStream(fmt, frozenset(NAMES))
    shown: list[str] = []
    streamed: list[tool_calls.CallDelta] = []
    for at in range(0, len(text), 3):  # three characters at a time: markers split everywhere
        piece, found = stream.feed(text[at : at + 3])
        shown.append(piece)
        streamed.extend(found)
        assert ("<tool_call>" not in "".join(shown) and "[TOOL_CALLS]" not in "".join(shown)) or not whole_calls
    piece, found = stream.finish()
    shown.append(piece)
    streamed.extend(found)
    assert "".join(shown) == whole_text == stream.text
    assert [(c.index, c.name, c.arguments) for c in streamed] == [
        (i, c.name, c.arguments) for i, c in enumerate(whole_calls)
    ]
    assert len({c.id for c in streamed}) == len(streamed)


def test_detect_format_from_templates() -> None:
    assert tool_calls.detect_format("{% if tools %}<tool_call>{{ tools | tojson }}{% endif %}") == "hermes"
    assert tool_calls.detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert tool_calls.detect_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert tool_calls.detect_format("{{ messages }}") == ""


def test_a_template_without_tools_gets_the_preamble_and_keeps_calls_and_results(tiny_model: Path) -> None:
    template = (tiny_model / "chat_template.jinja").read_text()
    chat = ChatTemplate(template, {})
    assert not chat.renders_tools and chat.tool_format == "hermes"
    call = common_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    text = chat.render(
        [
            common_pb2.ChatMessage(role="user", content="Weather in Paris?"),
            common_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            common_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="18C"),
        ],
        tools=[WEATHER, TIME],
    )
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18C<|im_end|>" in text


def test_a_template_with_tools_renders_them_itself() -> None:
    source = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "Call as <tool_call>{}</tool_call>{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    chat = ChatTemplate(source, {})
    assert chat.renders_tools and chat.tool_format == "hermes"
    text = chat.render([common_pb2.ChatMessage(role="user", content="hi")], tools=[WEATHER, TIME])
    assert text == "TOOLS:get_weather;get_time;Call as <tool_call>{}</tool_call>[user]hi"
    assert ChatTemplate(source, {}, "llama3").tool_format == "llama3"  # the setting names the format


def test_the_auto_grammar_allows_text_or_valid_calls_only(tiny_model: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ll = LLTokenizer(tokenizer.to_str(), eos_token=[0])
    grammar = LLMatcher.grammar_from_lark(tool_calls.auto_grammar([WEATHER, TIME]))

    def accepts(text: str) -> bool:
        matcher = LLMatcher(ll, grammar)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()

    assert accepts("It is sunny <b>today</b>.")
    assert accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert accepts(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert not accepts('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')  # city required
    assert not accepts("Sure: <tool_call>")  # a call is never text


def test_the_openai_backend_sends_the_calls_grammar_as_structured_outputs() -> None:
    from services.inference.engine.decoding import ResponseFormatSpec
    from services.inference.openai_protocol import format_fields

    grammar = tool_calls.auto_grammar([WEATHER])
    # vLLM's guidance backend takes a Lark grammar marked as llguidance's dialect as it is.
    assert format_fields(ResponseFormatSpec(kind="grammar", grammar=grammar)) == {
        "structured_outputs": {"grammar": "%llguidance {}\n" + grammar}
    }
