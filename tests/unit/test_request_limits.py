"""Request limits read on a request's bytes before it is parsed (llmesh/request_limits.py)."""

from __future__ import annotations

import pytest

from llmesh.request_limits import COUNT_ABOVE_BYTES, RequestLimit, largest_field, repeated_paths
from llmesh.v1 import common_pb2, gateway_pb2

COUNTS = {
    "messages": 4,
    "messages.tool_calls": 2,
    "tools": 3,
    "sampling.stop": 4,
    "sampling.logit_bias": 5,
    "response_format.choices": 6,
}


def limit(max_bytes: int = 1 << 20) -> RequestLimit:
    return RequestLimit(gateway_pb2.GenerateRequest, max_bytes, "LLMESH_TEST_BYTES", COUNTS)


def padded(request: gateway_pb2.GenerateRequest) -> bytes:
    """The request past the size below which nothing is counted (the system prompt pads it)."""
    request.system_prompt = "x" * COUNT_ABOVE_BYTES
    return request.SerializeToString()


def test_every_repeated_message_or_string_field_needs_a_count() -> None:
    # Packed numbers (token ids) cost their bytes parsed, as they do unparsed: no count needed.
    packed = {"sampling.stop_token_ids", "prompt_token_ids"}
    assert set(repeated_paths(gateway_pb2.GenerateRequest.DESCRIPTOR)) == {*COUNTS, *packed}
    uncounted = {k: v for k, v in COUNTS.items() if k != "messages.tool_calls"}
    with pytest.raises(ValueError, match=r"messages\.tool_calls"):
        RequestLimit(gateway_pb2.GenerateRequest, 1024, "X", uncounted)


def test_counts_are_checked_unparsed_and_name_the_field() -> None:
    request = gateway_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")] * 5)
    refused = limit().refusal(padded(request), "Generate")
    assert refused is not None and refused.violations == [("messages", "at most 4 elements")]
    nested = gateway_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(tool_calls=[common_pb2.ToolCall()] * 3)])
    refused = limit().refusal(padded(nested), "Generate")
    assert refused is not None and refused.violations[0][0] == "messages[0].tool_calls"
    bias = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(logit_bias={i: 1.0 for i in range(6)}))
    refused = limit().refusal(padded(bias), "Generate")
    assert refused is not None and refused.violations[0] == ("sampling.logit_bias", "at most 5 entries")


def test_a_request_within_its_counts_is_left_to_the_full_parse() -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", tool_calls=[common_pb2.ToolCall()] * 2)] * 4,
        tools=[common_pb2.Tool(name="f")] * 3,
    )
    assert limit().refusal(padded(request), "Generate") is None
    assert limit().refusal(b"\xff\xff\xff", "Generate") is None  # not a message: the full parse says so


def test_an_oversized_request_names_the_field_holding_most_of_it() -> None:
    request = gateway_pb2.GenerateRequest(prompt="hi", tools=[common_pb2.Tool(name="f", parameters="{" * 5000)])
    refused = limit(max_bytes=4096).refusal(request.SerializeToString(), "Generate")
    assert refused is not None
    assert refused.violations[0][0] == "tools[0].parameters"
    assert "takes at most 4096 (LLMESH_TEST_BYTES)" in refused.violations[0][1]


def test_largest_field_reads_a_bounded_number_of_fields() -> None:
    # A million empty turns: the look stops after a few dozen fields, whatever follows.
    raw = b"\x5a\x00" * 1_000_000
    assert largest_field(gateway_pb2.GenerateRequest.DESCRIPTOR, raw)[0] == "messages"
    assert largest_field(gateway_pb2.GenerateRequest.DESCRIPTOR, b"\xff") == ("", 0)
