"""The builtin engine under response formats (tiny random-weight model, real tokenizer): rows with
and without grammars share a batch, the grammar never changes a neighbour's tokens, and a reply
cut by its budget still parses (finish_reason length)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from bench.schemas import SCHEMAS
from llmesh.errors import InvalidArgument
from llmesh.models import verify
from services.inference.engine import Engine, EngineConfig, LoadedModel
from services.inference.engine.config import FINISH_LENGTH
from services.inference.engine.decoding import ResponseFormatSpec, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    loaded = LoadedModel(verify(tiny_model), "cpu", "float32")
    eng = Engine(loaded, EngineConfig(max_batch_size=8, max_prompt_tokens=256, max_new_tokens=256))
    eng.start()
    yield eng
    eng.close()


async def run(engine: Engine, prompt: str, params: SamplingParams) -> tuple[list[int], str, str]:
    tokens: list[int] = []
    text = ""
    finish = ""
    async for event in engine.submit(engine.encode(prompt), params):
        tokens += event.token_ids
        text += event.text
        finish = event.finish_reason or finish
    return tokens, text, finish


def as_schema(schema: object) -> ResponseFormatSpec:
    return ResponseFormatSpec(kind="json_schema", schema=json.dumps(schema))


async def test_constrained_and_free_rows_in_one_batch_and_free_rows_are_unchanged(engine: Engine) -> None:
    free = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = await run(engine, "Tell me about the sea", free)
    constrained = [
        SamplingParams(max_new_tokens=48, temperature=0.8, seed=i, response_format=as_schema(schema))
        for i, (_, schema) in enumerate(SCHEMAS[:6])
    ]
    results = await asyncio.gather(
        run(engine, "Tell me about the sea", free),
        *(run(engine, q, p) for (q, _), p in zip(SCHEMAS, constrained, strict=False)),
    )
    assert results[0][0] == alone[0]  # the free row's tokens do not depend on its grammar-bound neighbours
    for (_, schema), (_, text, _) in zip(SCHEMAS, results[1:], strict=False):
        jsonschema.validate(json.loads(text), schema)


async def test_a_reply_cut_by_its_budget_closes_and_says_length(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, response_format=as_schema(schema))
    tokens, text, finish = await run(engine, "Tell a long story", params)
    assert len(tokens) <= 16
    jsonschema.validate(json.loads(text), schema)
    assert finish in (FINISH_LENGTH, "stop")


async def test_a_format_that_cannot_fit_or_compile_is_refused_at_submit(engine: Engine) -> None:
    big = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string"} for i in range(12)},
        "required": [f"k{i}" for i in range(12)],
    }
    with pytest.raises(InvalidArgument) as info:
        engine.submit(engine.encode("x"), SamplingParams(max_new_tokens=6, response_format=as_schema(big)))
    assert info.value.violations[0][0] == "sampling.max_new_tokens"
    with pytest.raises(InvalidArgument) as info:
        engine.submit(
            engine.encode("x"), SamplingParams(max_new_tokens=6, response_format=ResponseFormatSpec("regex", regex="("))
        )
    assert info.value.violations[0][0] == "response_format.regex"


async def test_stop_token_ids_and_logit_bias_in_the_engine(engine: Engine) -> None:
    free = SamplingParams(max_new_tokens=12, ignore_eos=True)
    tokens, _, _ = await run(engine, "Tell me about the sea", free)
    stop_at = tokens[3]
    stopped, _, finish = await run(
        engine, "Tell me about the sea", SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    )
    # Like EOS, the stop token is sent and counted as a token id (not as text) and ends the row.
    assert stopped == tokens[: tokens.index(stop_at) + 1] and finish == "stop"
    forced, _, _ = await run(
        engine, "Tell me about the sea", SamplingParams(max_new_tokens=4, ignore_eos=True, logit_bias=((42, 100.0),))
    )
    assert forced == [42, 42, 42, 42]
    with pytest.raises(InvalidArgument) as info:
        engine.submit(engine.encode("x"), SamplingParams(max_new_tokens=4, presence_penalty=3.0, top_k=-1))
    assert {f for f, _ in info.value.violations} == {"sampling.presence_penalty", "sampling.top_k"}
