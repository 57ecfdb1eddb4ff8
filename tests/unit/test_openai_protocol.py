"""The openai backend's mappings: sampling parameters to a completions body, streamed chunks to
events, HTTP failures to typed errors with the right status, field and retry delay."""

from __future__ import annotations

import email.utils
import json

import grpc
import pytest

from llmesh import errors
from services.inference.engine import FINISH_LENGTH, FINISH_STOP, FINISH_STOP_SEQUENCE
from services.inference.engine.decoding import ResolvedParams
from services.inference.openai_protocol import (
    EchoSplitter,
    completion_body,
    error_for_status,
    parse_chunk,
    retry_after_seconds,
    token_logprobs,
)


def params(**kw: object) -> ResolvedParams:
    base: dict[str, object] = {
        "max_new_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": None,
        "stop": (),
        "ignore_eos": False,
    }
    return ResolvedParams(**{**base, **kw})  # type: ignore[arg-type]


def test_parameters_map_one_to_one() -> None:
    body = completion_body("smollm2", [1, 2, 3], params(seed=7, stop=("\n\n",), ignore_eos=True))
    assert body == {
        "model": "smollm2",
        "prompt": [1, 2, 3],
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 7,
        "stop": ["\n\n"],
        "ignore_eos": True,
    }
    plain = completion_body("m", "text prompt", params())
    assert plain["prompt"] == "text prompt"
    assert not {"seed", "stop", "ignore_eos"} & plain.keys(), "unset parameters are not sent"


def test_chunks_carry_text_finish_and_usage() -> None:
    piece = parse_chunk(json.dumps({"id": "c1", "model": "m", "choices": [{"text": "Par", "finish_reason": None}]}))
    assert (piece.text, piece.finish_reason, piece.prompt_tokens) == ("Par", None, None)
    last = parse_chunk(json.dumps({"choices": [{"text": "is", "finish_reason": "length", "stop_reason": None}]}))
    assert (last.text, last.finish_reason) == ("is", FINISH_LENGTH)
    usage = parse_chunk(
        json.dumps({"id": "c1", "model": "m", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}})
    )
    assert (usage.prompt_tokens, usage.completion_tokens, usage.model, usage.response_id) == (12, 5, "m", "c1")
    stop_string = parse_chunk(json.dumps({"choices": [{"text": "", "finish_reason": "stop", "stop_reason": "\n"}]}))
    assert stop_string.finish_reason == FINISH_STOP_SEQUENCE
    eos = parse_chunk(json.dumps({"choices": [{"text": "", "finish_reason": "stop", "stop_reason": None}]}))
    assert eos.finish_reason == FINISH_STOP


def test_an_error_inside_the_stream_raises_its_typed_error() -> None:
    with pytest.raises(errors.Unavailable):
        parse_chunk(json.dumps({"error": {"message": "engine died", "code": 500}}))
    with pytest.raises(errors.InvalidArgument):
        parse_chunk(json.dumps({"object": "error", "message": "bad top_p", "code": 400}))
    with pytest.raises(errors.Unavailable):
        parse_chunk("{not json")
    with pytest.raises(errors.Unavailable):
        parse_chunk(json.dumps({"choices": [{"text": "", "finish_reason": "abort"}]}))


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("0.5") == 0.5
    assert retry_after_seconds(None) == 1.0
    assert retry_after_seconds("soon") == 1.0
    assert retry_after_seconds("-4") == 0.0
    assert retry_after_seconds("99999") == 300.0
    now = 1_800_000_000.0
    assert retry_after_seconds(email.utils.formatdate(now + 20, usegmt=True), now=now) == pytest.approx(20, abs=1)


@pytest.mark.parametrize(
    "status,code",
    [
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (503, grpc.StatusCode.UNAVAILABLE),
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (422, grpc.StatusCode.INVALID_ARGUMENT),
        (401, grpc.StatusCode.FAILED_PRECONDITION),
        (404, grpc.StatusCode.UNAVAILABLE),
        (500, grpc.StatusCode.UNAVAILABLE),
        (502, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_http_statuses_map_to_grpc_codes(status: int, code: grpc.StatusCode) -> None:
    assert error_for_status(status, {}, b'{"error": {"message": "no"}}').code == code


def test_overload_and_unavailable_carry_retry_info_from_retry_after() -> None:
    for status in (429, 503):
        error = error_for_status(status, {"retry-after": "7"}, b"busy")
        details = errors.unpack_details(errors.status_details(error.trailing_metadata()))
        assert details["retry_info"].retry_delay.seconds == 7, status  # type: ignore[attr-defined]


def test_a_rejected_parameter_names_our_field() -> None:
    by_param = error_for_status(400, {}, json.dumps({"error": {"message": "too big", "param": "max_tokens"}}).encode())
    assert isinstance(by_param, errors.InvalidArgument)
    assert by_param.violations[0][0] == "sampling.max_new_tokens"
    by_location = error_for_status(400, {}, json.dumps({"error": {"message": "bad", "param": "body.seed"}}).encode())
    assert isinstance(by_location, errors.InvalidArgument) and by_location.violations[0][0] == "sampling.seed"
    # vLLM names the parameter in its message only (pydantic's validation text).
    by_text = error_for_status(
        400, {}, json.dumps({"error": {"message": "1 validation error: seed Input should be less than 9e18"}}).encode()
    )
    assert isinstance(by_text, errors.InvalidArgument) and by_text.violations[0][0] == "sampling.seed"
    unknown = error_for_status(400, {}, b"plain text")
    assert isinstance(unknown, errors.InvalidArgument) and unknown.violations[0][0] == "sampling"


def test_response_formats_are_passed_as_vllm_takes_them() -> None:
    from services.inference.engine.decoding import ResponseFormatSpec
    from services.inference.openai_protocol import completion_body as body_of

    resolved = ResolvedParams(max_new_tokens=8, temperature=0.0, top_p=1.0, seed=None, stop=(), ignore_eos=False)
    schema = ResponseFormatSpec("json_schema", schema='{"type": "object"}', strict=True, name="thing")
    assert body_of("m", [1], resolved, response_format=schema)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": {"type": "object"}, "strict": True},
    }
    assert body_of("m", [1], resolved, response_format=ResponseFormatSpec("json_object"))["response_format"] == {
        "type": "json_object"
    }
    regex = body_of("m", [1], resolved, response_format=ResponseFormatSpec("regex", regex="[0-9]+"))
    assert regex["structured_outputs"] == {"regex": "[0-9]+"}
    choice = body_of("m", [1], resolved, response_format=ResponseFormatSpec("choice", choices=("a", "b")))
    assert choice["structured_outputs"] == {"choice": ["a", "b"]}
    assert "response_format" not in body_of("m", [1], resolved)


def test_logprobs_are_asked_by_token_id_and_mapped_back_likeliest_first() -> None:
    body = completion_body("m", [1], params(logprobs=True, top_logprobs=2))
    assert (body["logprobs"], body["return_tokens_as_token_ids"]) == (2, True)
    assert "logprobs" not in completion_body("m", [1], params())
    # vLLM lists the chosen token among the alternatives even when it is not one of the likeliest.
    chunk = parse_chunk(
        json.dumps(
            {
                "choices": [
                    {
                        "text": " Paris",
                        "logprobs": {
                            "tokens": ["token_id:7"],
                            "token_logprobs": [-2.5],
                            "top_logprobs": [{"token_id:7": -2.5, "token_id:3": -0.1, "token_id:9": -1.0}],
                            "text_offset": [0],
                        },
                    }
                ]
            }
        )
    )
    names = {7: (" Paris", b" Paris"), 3: ("\ufffd", b"\xf0"), 9: (" Rome", b" Rome")}

    def piece_of(token: str) -> tuple[int, str, bytes]:
        token_id = int(token.removeprefix("token_id:"))
        return (token_id, *names[token_id])

    (entry,) = token_logprobs(chunk.logprobs, 2, piece_of)
    assert (entry.token_id, entry.token, entry.logprob, entry.bytes) == (7, " Paris", -2.5, b" Paris")
    assert [(t.token_id, t.logprob, t.bytes) for t in entry.top] == [(3, -0.1, b"\xf0"), (9, -1.0, b" Rome")]
    (only,) = token_logprobs(chunk.logprobs, 0, piece_of)
    assert only.top == ()


def test_vllms_fields_are_forwarded_as_vllm_names_them() -> None:
    body = completion_body(
        "m",
        [1, 2],
        params(min_new_tokens=4, keep_special_tokens=True, include_stop_str=True, ignore_eos=True),
    )
    assert body["min_tokens"] == 4 and body["skip_special_tokens"] is False
    assert body["include_stop_str_in_output"] is True and body["ignore_eos"] is True
    plain = completion_body("m", [1, 2], params())
    assert not {"min_tokens", "skip_special_tokens", "include_stop_str_in_output", "echo"} & plain.keys()


def test_prompt_scores_are_asked_as_an_echo_with_logprobs_and_split_off_the_stream() -> None:
    scored = completion_body("m", [1, 2, 3], params(prompt_logprobs=2, logprobs=True, top_logprobs=1))
    # vLLM refuses prompt_logprobs on a stream: echo with logprobs scores the prompt there.
    assert scored["echo"] is True and scored["logprobs"] == 2 and scored["return_tokens_as_token_ids"] is True
    assert "prompt_logprobs" not in scored and scored["max_tokens"] == 16
    read_only = completion_body("m", [1, 2, 3], params(prompt_only=True, prompt_logprobs=0))
    assert read_only["max_tokens"] == 0 and read_only["echo"] is True

    splitter = EchoSplitter(3, "Hello world")
    first = parse_chunk(
        json.dumps(
            {
                "choices": [
                    {
                        "text": "Hello world!",
                        "logprobs": {
                            "tokens": ["token_id:1", "token_id:2", "token_id:3", "token_id:4"],
                            "token_logprobs": [None, -1.5, -0.5, -2.0],
                            "top_logprobs": [None, {"token_id:2": -1.5}, {"token_id:3": -0.5}, {"token_id:4": -2.0}],
                        },
                        "finish_reason": None,
                    }
                ]
            }
        )
    )
    rest = splitter.split(first)
    assert rest.text == "!" and [t for t, _, _ in rest.logprobs] == ["token_id:4"]
    assert [v for _, v, _ in splitter.prompt] == [None, -1.5, -0.5]
    later = parse_chunk(json.dumps({"choices": [{"text": " Bye", "finish_reason": None}]}))
    assert splitter.split(later).text == " Bye"


def test_the_servers_cached_tokens_are_read_from_the_usage() -> None:
    usage = parse_chunk(
        json.dumps(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 700,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 640},
                },
            }
        )
    )
    assert usage.cached_tokens == 640
    assert parse_chunk(json.dumps({"choices": [], "usage": {"prompt_tokens": 7}})).cached_tokens is None
