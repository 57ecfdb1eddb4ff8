"""Incremental detokenization, stop strings and request validation (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llmesh.errors import InvalidArgument
from services.inference.engine.decoding import (
    IncrementalDecoder,
    Limits,
    SamplingParams,
    StopMatcher,
    resolve_params,
)

LIMITS = Limits(
    max_prompt_tokens=16, max_new_tokens=32, default_max_new_tokens=8, max_context_tokens=40, vocab_size=1000
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tokenizer)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", ["héllo 🌍 ok", "日本語のテキスト 🎉🎉 fin", "ça va? — naïve café ✓"])
def test_incremental_decoder_never_splits_a_character(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    # The tokenizer really splits these characters across tokens (else the test proves nothing).
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_decoder_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False).ids
    assert "".join(stream(tokenizer, ids)) == "assistant\nHi there"


def test_stop_matcher_holds_back_partial_matches() -> None:
    matcher = StopMatcher(("STOP", "xyz"))
    out = []
    for delta in ["hello S", "T", "O", "x", "P and more"]:
        text, stopped = matcher.push(delta)
        out.append(text)
        if stopped:
            break
    # "S", "ST", "STO" are held back as possible starts of STOP; "x" breaks that match (and is held
    # as a possible start of "xyz" until "P" breaks it too): nothing is lost, nothing matched.
    assert "".join(out) + matcher.flush() == "hello STOxP and more"

    matcher = StopMatcher(("STOP",))
    texts = []
    stopped = False
    for delta in ["a ST", "OP b"]:
        text, stopped = matcher.push(delta)
        texts.append(text)
        if stopped:
            break
    assert stopped and "".join(texts) == "a "


def test_stop_matcher_finds_earliest_stop_across_strings() -> None:
    matcher = StopMatcher(("world", "lo w"))
    text, stopped = matcher.push("hello world")
    assert stopped and text == "hel"


def test_resolve_params_defaults() -> None:
    p = resolve_params(SamplingParams(), [1, 2, 3], LIMITS)
    assert p.max_new_tokens == 8 and p.top_p == 1.0 and p.greedy and p.seed is None
    # The default is trimmed to the room the context leaves; an explicit value is not.
    p = resolve_params(SamplingParams(), list(range(1, 17)), Limits(16, 32, 8, 20, 1000))
    assert p.max_new_tokens == 4


@pytest.mark.parametrize(
    ("params", "prompt", "field", "needle"),
    [
        (SamplingParams(), list(range(17)), "input", "limit is 16 (LLMESH_MAX_PROMPT_TOKENS)"),
        (SamplingParams(), [], "input", "empty"),
        (SamplingParams(), [5, 1000], "token_ids.ids", "outside the vocabulary"),
        (SamplingParams(max_new_tokens=33), [1], "sampling.max_new_tokens", "at most 32"),
        (SamplingParams(max_new_tokens=30), list(range(15)), "sampling.max_new_tokens", "context of 40"),
        (SamplingParams(temperature=2.5), [1], "sampling.temperature", "[0, 2]"),
        (SamplingParams(temperature=float("nan")), [1], "sampling.temperature", "[0, 2]"),
        (SamplingParams(top_p=1.5), [1], "sampling.top_p", "[0, 1]"),
        (SamplingParams(stop=("a", "b", "c", "d", "e")), [1], "sampling.stop", "at most 4"),
        (SamplingParams(stop=("é" * 33,)), [1], "sampling.stop[0]", "64 bytes"),
        (SamplingParams(stop=("",)), [1], "sampling.stop[0]", "empty"),
    ],
)
def test_resolve_params_rejects(params: SamplingParams, prompt: list[int], field: str, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        resolve_params(params, prompt, LIMITS)
    fields = dict(info.value.violations)
    assert field in fields, info.value.violations
    assert needle in fields[field]
