"""The engine step on the tiny model, pinned: greedy and seeded tokens that the engine produced
before its step was restructured (scheduler plan, runner, scheduler update) must come out
bit-identical after it, in float32, through every path the step takes: a batch of prompts
prefilled together, rows joining a running batch, a long prompt prefilled in chunks inside the
decode step, the prefix cache, a row preempted for KV blocks, a grammar-free seeded sample, and
n>1 style repeats of one prompt."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import pytest

from llmesh.models import verify
from llmesh.testing import record_calls
from services.inference.engine import Engine, EngineConfig, LoadedModel
from services.inference.engine.decoding import SamplingParams

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu", "float32")


def side_engine(loaded: LoadedModel, **config: object) -> Engine:
    eng = Engine(loaded, EngineConfig(**{"max_prompt_tokens": 512, "max_new_tokens": 64, **config}))  # type: ignore[arg-type]
    eng.start()
    return eng


async def run(engine: Engine, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for event in engine.submit(ids, params):
        tokens += event.token_ids
    return tokens


def digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(repr(outputs).encode()).hexdigest()[:16]


def texts(loaded: LoadedModel) -> list[list[int]]:
    words = ["Hi", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea " * 4, "é 🌍 ok?"]
    return [[1, *loaded.encode(t)] for t in words]


async def test_a_batch_prefilled_together_and_rows_joining(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=8)
    try:
        ps = texts(loaded)
        together = await asyncio.gather(*(run(eng, p) for p in ps))
        first = asyncio.create_task(run(eng, ps[2], SamplingParams(max_new_tokens=40, ignore_eos=True)))
        joined = []
        for p in ps:
            joined.append(await run(eng, p))
        long_row = await first
        assert together == joined
        assert (digest(together), digest([long_row])) == PINNED["batch"]
    finally:
        eng.close()


@pytest.mark.parametrize("mix", [True, False])
async def test_a_prompt_arriving_while_a_row_decodes_is_prefilled_in_its_forward(
    loaded: LoadedModel, mix: bool
) -> None:
    """No forward of its own (LLMESH_MIX_PROMPTS=1): the decode row's forward takes
    the new prompt's tokens too, and both produce the tokens they produce apart. Unmixed, the
    prompt has its own prefill forward first."""
    eng = side_engine(loaded, max_batch_size=4, mix_prompts=mix)
    try:
        ps = texts(loaded)
        alone = [await run(eng, p) for p in ps[:2]]
        forwards = record_calls(eng.runner, ("prefill_scored", "mixed", "decode_scored"))
        # The worker holds its first decode step until the second prompt is queued: the next
        # iteration then admits it while the row still has tokens to go.
        queued = threading.Event()
        eng.fault_hook = lambda kind, rows: queued.wait(30) if kind == "decode" else None
        decoding = eng.submit(ps[0], GREEDY)
        first = await anext(aiter(decoding))  # its prefill's token; the row decodes from here on
        second = eng.submit(ps[1], GREEDY)
        queued.set()
        rest = first.token_ids + [t async for e in decoding for t in e.token_ids]
        beside = [t async for e in second for t in e.token_ids]
        assert [rest, beside] == alone
        if mix:
            assert forwards.count("prefill_scored") == 1  # the first prompt's, before any row decoded
            assert "mixed" in forwards
        else:
            assert forwards.count("prefill_scored") == 2 and "mixed" not in forwards
    finally:
        eng.close()


async def test_a_long_prompt_chunked_inside_the_decode_step(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=4, prefix_caching=False, max_prefill_tokens=128)
    try:
        long_prompt = [1, *loaded.encode("Tell me about the sea, the sky and everything in between. " * 30)]
        assert len(long_prompt) > 300
        short = asyncio.create_task(run(eng, texts(loaded)[1], SamplingParams(max_new_tokens=60, ignore_eos=True)))
        long_tokens = await run(eng, long_prompt, GREEDY)
        assert (digest([await short]), digest([long_tokens])) == PINNED["chunked"]
    finally:
        eng.close()


async def test_a_scored_long_prompt_is_chunked_on_its_own_beside_a_decoding_row(loaded: LoadedModel) -> None:
    # Scoring a prompt needs every chunk position's logits, which a mixed step does not return:
    # the scheduler plans its chunks alone even while a row decodes, and every token is scored.
    eng = side_engine(loaded, max_batch_size=4, prefix_caching=False, max_prefill_tokens=128)
    try:
        long_prompt = [1, *loaded.encode("Tell me about the sea, the sky and everything in between. " * 30)]
        params = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=0)
        alone_events = [e async for e in eng.submit(long_prompt, params)]
        alone = alone_events[0].prompt_logprobs
        short = asyncio.create_task(run(eng, texts(loaded)[1], SamplingParams(max_new_tokens=60, ignore_eos=True)))
        beside_events = [e async for e in eng.submit(long_prompt, params)]
        beside = beside_events[0].prompt_logprobs
        await short
        assert [e.token_id for e in beside] == long_prompt
        assert [e.logprob for e in beside] == pytest.approx([e.logprob for e in alone], abs=1e-4)
    finally:
        eng.close()


async def test_the_prefix_cache_and_a_preempted_row(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=8, max_batch_total_tokens=48, max_prompt_tokens=16, max_new_tokens=30)
    try:
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        a, b = [1, *loaded.encode("Hello there")], [1, *loaded.encode("Tell me")]
        together = await asyncio.gather(run(eng, a, params), run(eng, b, params))
        assert eng.preemptions >= 1
        again = await run(eng, a, params)  # its prefix is cached now
        assert again == together[0]
        assert digest(together) == PINNED["preempted"]
    finally:
        eng.close()


async def test_seeded_samples_and_repeats(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=8)
    try:
        ids = texts(loaded)[1]
        sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        penalised = SamplingParams(max_new_tokens=16, repetition_penalty=1.3, top_k=5, seed=3, temperature=0.7)
        outs = await asyncio.gather(
            run(eng, ids, sampled), run(eng, ids, sampled), run(eng, ids, penalised), run(eng, ids, GREEDY)
        )
        assert outs[0] == outs[1]
        assert digest(outs) == PINNED["sampled"]
    finally:
        eng.close()


#: Produced by the engine before its step was restructured (sha256 of the token lists).
PINNED: dict[str, object] = {
    "batch": ("64357875ef612ac7", "26499f5838855672"),
    "chunked": ("297383d456b26db1", "dce16be1184fd975"),
    "preempted": "1e5c82ab5427140a",
    "sampled": "f171bf40c968e13c",
}
