"""The openai backend's SSE framing (`SSEReader`) and chunk coalescing (`merge_chunks`)."""

from __future__ import annotations

import json

import pytest

from services.inference.openai_protocol import Chunk, SSEReader, merge_chunks, parse_chunk

STREAM = (
    b'data: {"choices": [{"text": "Par"}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"choices": [{"text": "is"}]}\n\n'
    b"event: message\nid: 7\nretry: 100\n"
    b'data: {"a":\ndata: 1}\n\n'
    b"data: [DONE]\n\n"
)
EVENTS = [b'{"choices": [{"text": "Par"}]}', b'{"choices": [{"text": "is"}]}', b'{"a":\n1}']


def read_all(reader: SSEReader, pieces: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for piece in pieces:
        out += reader.feed(piece)
    return out


def test_whole_stream_in_one_read_gives_every_event_then_done() -> None:
    reader = SSEReader()
    assert reader.feed(STREAM) == EVENTS
    assert reader.done
    assert reader.feed(b'data: {"late": 1}\n\n') == []  # nothing after [DONE]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_split_at_every_byte_boundary_gives_the_same_events(newline: bytes) -> None:
    stream = STREAM.replace(b"\n", newline)
    for cut in range(len(stream) + 1):
        reader = SSEReader()
        assert read_all(reader, [stream[:cut], stream[cut:]]) == EVENTS, (newline, cut)
        assert reader.done


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_one_byte_per_read(newline: bytes) -> None:
    stream = STREAM.replace(b"\n", newline)
    reader = SSEReader()
    assert read_all(reader, [stream[i : i + 1] for i in range(len(stream))]) == EVENTS
    assert reader.done


def test_an_event_is_given_as_soon_as_its_blank_line_arrives() -> None:
    reader = SSEReader()
    assert reader.feed(b'data: {"x": 1}\n') == []
    assert reader.feed(b"\n") == [b'{"x": 1}']
    assert reader.feed(b'data: {"y": 2}\r\n\r') == [b'{"y": 2}']  # a CR ends a line without its LF
    assert reader.feed(b'\ndata: {"z": 3}\n\n') == [b'{"z": 3}']  # that LF is the CRLF's, not a blank line
    assert not reader.done


def test_keepalives_comments_and_empty_events_give_nothing() -> None:
    reader = SSEReader()
    assert reader.feed(b": ping\n\n:\n\n\n\nevent: x\n\n") == []
    assert reader.feed(b"data\n\n") == [b""]  # a field without a colon: empty data
    assert reader.feed(b"data:no-space\n\n") == [b"no-space"]
    assert not reader.done


def test_done_mid_read_stops_there() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: 1\n\ndata: [DONE]\n\ndata: 2\n\n") == [b"1"]
    assert reader.done


def test_parse_chunk_takes_the_raw_bytes_and_token_ids() -> None:
    chunk = parse_chunk(json.dumps({"choices": [{"text": "a", "token_ids": [5, 6]}]}).encode())
    assert chunk.text == "a"
    assert chunk.token_ids == (5, 6)


def test_merge_of_one_is_that_chunk() -> None:
    only = Chunk(text="x")
    assert merge_chunks([only]) is only


def test_merge_concatenates_text_ids_and_logprobs_in_order() -> None:
    first = Chunk(text="Pa", token_ids=(1,), logprobs=(("token_id:1", -0.5, {"token_id:1": -0.5}),), model="m")
    second = Chunk(text="ris", token_ids=(2, 3), logprobs=(("token_id:2", None, None), ("token_id:3", -1.0, None)))
    merged = merge_chunks([first, second])
    assert merged.text == "Paris"
    assert merged.token_ids == (1, 2, 3)
    assert merged.logprobs == first.logprobs + second.logprobs
    assert merged.model == "m"
    assert merged.finish_reason is None
    assert merged.prompt_tokens is None and merged.completion_tokens is None


def test_merge_keeps_the_finish_reason_and_usage_of_the_chunks_that_carry_them() -> None:
    token = Chunk(text="!", response_id="c1", model="m")
    last = Chunk(text="", finish_reason="length", response_id="c1", model="m")
    usage = Chunk(prompt_tokens=7, completion_tokens=2, response_id="c1", model="m")
    merged = merge_chunks([token, last, usage])
    assert merged.text == "!"
    assert merged.finish_reason == "length"
    assert (merged.prompt_tokens, merged.completion_tokens) == (7, 2)
    assert (merged.model, merged.response_id) == ("m", "c1")
    # A later chunk without a finish reason does not erase an earlier one.
    assert merge_chunks([last, Chunk(text="")]).finish_reason == "length"
    # Zero counts are counts.
    assert merge_chunks([Chunk(prompt_tokens=0, completion_tokens=0), Chunk()]).completion_tokens == 0


def test_merged_text_only_chunks_say_how_many_tokens_they_stand_for() -> None:
    # A server that streams text only sends a chunk per token: three merged are three tokens,
    # which the gateway counts for admission progress and for billing a stream that ends early.
    merged = merge_chunks([Chunk(text="a"), Chunk(text="b"), Chunk(text=""), Chunk(text="c")])
    assert merged.text == "abc" and merged.tokens == 3
    with_ids = merge_chunks([Chunk(text="a", token_ids=(1, 2)), Chunk(text="b")])
    assert with_ids.tokens == 3
    assert merge_chunks([merged, Chunk(text="d")]).tokens == 4


def test_the_inference_response_carries_the_count_only_without_ids() -> None:
    from services.inference.engine.sequence import GenerationEvent
    from services.inference.servicer import response_for

    assert response_for(GenerationEvent([], "abc", tokens=3)).tokens == 3
    with_ids = response_for(GenerationEvent([7, 8], "ab", tokens=2))
    assert list(with_ids.token_ids) == [7, 8] and with_ids.tokens == 0
