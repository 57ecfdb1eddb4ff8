"""The SSE chunks of the gateway's HTTP API: the per-token chunk is written from bytes prepared
once, and must be exactly the chunk the general path builds."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_http import Answer

# Non-empty: an empty delta takes the general path.
TEXTS = [" Paris", 'a "quoted" \\\\ back', "line\nbreak\ttab", "é 中文 🙂", "\u2028", "\x00\x1f"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage_null", [False, True])
def test_a_delta_chunk_is_byte_for_byte_the_general_chunk(chat: bool, usage_null: bool) -> None:
    fast, general = Answer('cmpl-x"y', 'model "m"', chat), Answer('cmpl-x"y', 'model "m"', chat)
    for index in (0, 3):
        for text in TEXTS:
            usage = {"usage": None} if usage_null else {}
            expected = general._chunk([general._choice(text, None, index=index)], **usage)
            assert fast._delta_chunk(text, index, usage_null) == expected
    assert fast.offsets == general.offsets  # completions: each answer's text offset kept as the general path keeps it


def test_a_delta_chunk_is_one_server_sent_event_of_valid_json() -> None:
    answer = Answer("cmpl-1", "smollm2", chat=False)
    chunk = answer._delta_chunk("two\n\nlines", 0, True)
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1
    body = json.loads(chunk[len(b"data: ") :])
    assert body["choices"] == [{"index": 0, "text": "two\n\nlines", "logprobs": None, "finish_reason": None}]
    assert body["usage"] is None and body["object"] == "text_completion" and body["model"] == "smollm2"


def test_the_model_named_later_is_the_one_the_next_chunk_carries() -> None:
    answer = Answer("chatcmpl-1", "alias", chat=True)
    assert json.loads(answer._delta_chunk("a", 0, False)[6:])["model"] == "alias"
    answer.model = "smollm2"
    assert json.loads(answer._delta_chunk("b", 0, False)[6:])["model"] == "smollm2"
