"""The builtin engine on SmolLM2 (float32): prompt log probabilities (vLLM's prompt_logprobs, what
lm-evaluation-harness scores with) equal a direct transformers forward of the same weights, whole
or chunked, with or without a cached prefix; a prompt-only request (max_tokens 0) is read and
scored, nothing generated; min_new_tokens holds off EOS and stop tokens; the stop string can
stay in the text; and the usage says how many prompt tokens the prefix cache held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmesh.models import verify
from services.inference.engine import Engine, EngineConfig, GenerationEvent, LoadedModel
from services.inference.engine.decoding import SamplingParams

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a "
    "notebook and a thermos of tea. From the gallery he could see the fishing boats returning "
    "to the harbour, their wakes drawing silver lines across the darkening water."
)


@pytest.fixture(scope="module")
def smollm2(models_dir: Path) -> Path:
    return models_dir / "smollm2" / "current"


@pytest.fixture(scope="module")
def loaded(smollm2: Path) -> LoadedModel:
    return LoadedModel(verify(smollm2), "cpu", "float32")


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    # A small prefill budget: a long prompt is prefilled (and scored) in chunks.
    config = EngineConfig(max_batch_size=4, max_prompt_tokens=2048, max_new_tokens=128, max_prefill_tokens=32)
    eng = Engine(loaded, config)
    eng.start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), torch_dtype=torch.float32)
    model.eval()
    return model


def reference_scores(model: torch.nn.Module, ids: list[int], top: int) -> tuple[list[float], list[list[int]]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    dist = torch.log_softmax(logits, dim=-1)
    values = [float(dist[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    tops = dist[:-1].topk(top, dim=-1).indices.tolist() if top else [[] for _ in values]
    return values, tops


async def collect(engine: Engine, ids: list[int], params: SamplingParams) -> list[GenerationEvent]:
    return [event async for event in engine.submit(ids, params)]


async def test_prompt_logprobs_equal_a_transformers_forward_whole_chunked_and_after_a_cached_prefix(
    engine: Engine, reference: torch.nn.Module
) -> None:
    ids = engine.encode(TEXT)
    assert len(ids) > 32  # longer than one prefill chunk
    expected, tops = reference_scores(reference, ids, 3)
    # The first run fills the prefix cache; the second must still score every token (not reuse it).
    for _ in range(2):
        events = await collect(engine, ids, SamplingParams(max_new_tokens=2, prompt_logprobs=3))
        scored = events[0].prompt_logprobs
        assert [e.token_id for e in scored] == ids
        assert scored[0].logprob == 0.0 and scored[0].top == ()
        got = [e.logprob for e in scored[1:]]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-2
        assert [[t.token_id for t in e.top] for e in scored[1:]] == tops
        assert all(not e.prompt_logprobs for e in events[1:])
        assert "".join(e.token for e in scored) == TEXT


async def test_a_prompt_only_request_reads_and_scores_the_prompt_and_generates_nothing(engine: Engine) -> None:
    ids = engine.encode("Describe Paris in many sentences.")
    events = await collect(engine, ids, SamplingParams(prompt_only=True, prompt_logprobs=0))
    assert len(events) == 1
    last = events[0]
    assert last.finish_reason == "length" and last.token_ids == [] and last.text == ""
    assert last.output_tokens == 0 and last.input_tokens == len(ids)
    assert len(last.prompt_logprobs) == len(ids)
    assert all(e.logprob < 0 for e in last.prompt_logprobs[1:])


async def test_min_new_tokens_holds_off_stop_tokens_and_stop_strings(engine: Engine) -> None:
    ids = engine.encode("Count: one, two, three,")
    plain = await collect(engine, ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    generated = [t for e in plain for t in e.token_ids]
    first = generated[0]
    stopped = await collect(engine, ids, SamplingParams(max_new_tokens=12, stop_token_ids=(first,)))
    assert stopped[-1].output_tokens == 1 and stopped[-1].finish_reason == "stop"
    held = await collect(engine, ids, SamplingParams(max_new_tokens=12, stop_token_ids=(first,), min_new_tokens=6))
    tokens = [t for e in held for t in e.token_ids]
    assert len(tokens) >= 6 and first not in tokens[:6]
    text = "".join(e.text for e in plain)
    stop = text.strip()[:2]
    early = await collect(engine, ids, SamplingParams(max_new_tokens=12, stop=(stop,), ignore_eos=True))
    later = await collect(
        engine, ids, SamplingParams(max_new_tokens=12, stop=(stop,), ignore_eos=True, min_new_tokens=12)
    )
    assert early[-1].finish_reason == "stop_sequence" and early[-1].output_tokens < 12
    assert later[-1].output_tokens == 12


async def test_the_stop_string_stays_in_the_text_when_asked(engine: Engine) -> None:
    ids = engine.encode("Count: one, two, three,")
    text = "".join(e.text for e in await collect(engine, ids, SamplingParams(max_new_tokens=12, ignore_eos=True)))
    stop = text.strip()[:2]
    cut = "".join(e.text for e in await collect(engine, ids, SamplingParams(max_new_tokens=12, stop=(stop,))))
    keeping = SamplingParams(max_new_tokens=12, stop=(stop,), include_stop_str=True)
    kept = "".join(e.text for e in await collect(engine, ids, keeping))
    assert kept == cut + stop


async def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(engine: Engine) -> None:
    shared = engine.encode(TEXT.upper() * 2)  # a prefix no other test read
    asked = SamplingParams(max_new_tokens=2)
    first = await collect(engine, [*shared, *engine.encode(" What is the keeper carrying?")], asked)
    second = await collect(engine, [*shared, *engine.encode(" Where do the boats go?")], asked)
    block = engine.kv.block_tokens
    assert first[-1].cached_input_tokens == 0
    assert second[-1].cached_input_tokens >= len(shared) // block * block - block
    assert second[-1].cached_input_tokens <= second[-1].input_tokens
