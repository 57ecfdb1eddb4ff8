"""Prefix caching in the engine on the tiny real model (float32): a reused prefix gives the same
greedy tokens as a fresh prefill, whether shared whole, in part, through a conversation's
generated turn, or evicted and prefilled again; blocks go back to the pool after cancellation,
a deadline and an out-of-memory failure; eviction under pressure never takes a block in use."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from llmesh.errors import ResourceExhausted
from llmesh.models import verify
from services.inference.engine import Engine, EngineConfig, LoadedModel
from services.inference.engine.decoding import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu", "float32")


def make_engine(loaded: LoadedModel, **config: object) -> Engine:
    values: dict[str, object] = {"max_batch_size": 4, "max_prompt_tokens": 160, "max_new_tokens": 32, **config}
    eng = Engine(loaded, EngineConfig(**values))  # type: ignore[arg-type]
    eng.start()
    return eng


@pytest.fixture(scope="module")
def fresh(loaded: LoadedModel) -> Iterator[Engine]:
    eng = make_engine(loaded, prefix_caching=False)
    yield eng
    eng.close()


async def run(engine: Engine, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for event in engine.submit(ids, params):
        tokens += event.token_ids
    return tokens


def all_blocks_back(eng: Engine) -> bool:
    kv = eng.kv
    return kv.free_blocks == kv.usable_blocks and all(kv.refs(b) == 0 for b in range(1, kv.num_blocks))


def system_prompt(eng: Engine) -> list[int]:
    ids = eng.encode("You are a careful assistant for the harbour office. Answer briefly and politely. " * 4)
    assert len(ids) >= 48
    return ids


async def test_shared_and_partly_shared_prefixes_give_the_fresh_tokens(loaded: LoadedModel, fresh: Engine) -> None:
    eng = make_engine(loaded)
    try:
        system = system_prompt(eng)
        questions = [eng.encode(q) for q in (" When does the ferry leave?", " Is the pier open?", " Who runs it?")]
        prompts = [system + questions[0], system + questions[1], system[:37] + questions[2]]
        expected = [await run(fresh, p) for p in prompts]
        hits = sample("llmesh_inference_prefix_hit_tokens_total")
        got = [await run(eng, prompts[0])]
        assert eng.kv.stats().hit_tokens == 0
        got.append(await run(eng, prompts[1]))
        shared = (len(system) // 16) * 16
        assert eng.kv.stats().hit_tokens == shared  # the whole system prompt's full blocks
        got.append(await run(eng, prompts[2]))
        assert eng.kv.stats().hit_tokens == shared + 32  # 37 shared tokens: two full blocks
        assert got == expected
        assert sample("llmesh_inference_prefix_hit_tokens_total") - hits == shared + 32
        load = eng.load()
        assert 0 < load.prefix_hit_rate < 1 and load.prefix_hashes
        assert all_blocks_back(eng) and eng.kv.cached_blocks > 0
    finally:
        eng.close()


async def test_a_conversation_reuses_its_earlier_turn_including_the_generated_answer(
    loaded: LoadedModel, fresh: Engine
) -> None:
    eng = make_engine(loaded)
    try:
        turn1 = system_prompt(eng) + eng.encode(" Hello?")
        answer = await run(eng, turn1, SamplingParams(max_new_tokens=30, ignore_eos=True))
        turn2 = turn1 + answer + eng.encode(" And then?")
        before = eng.kv.stats().hit_tokens
        got = await run(eng, turn2)
        # What the first turn left in the cache: its tokens but the last generated one.
        assert eng.kv.stats().hit_tokens - before == ((len(turn1) + len(answer) - 1) // 16) * 16
        assert got == await run(fresh, turn2)
    finally:
        eng.close()


async def test_an_evicted_prefix_is_prefilled_again_to_the_same_tokens(loaded: LoadedModel, fresh: Engine) -> None:
    # 16 blocks: the system prompt's blocks are evicted by two other long prompts.
    eng = make_engine(loaded, max_batch_total_tokens=256, max_batch_size=2)
    try:
        system = system_prompt(eng)
        prompt = system + eng.encode(" When does the ferry leave?")
        expected = await run(fresh, prompt)
        assert await run(eng, prompt) == expected
        assert len(eng.kv.match(prompt)[0]) >= len(system) // 16
        for i in range(8):  # other prompts until the last of the prefix's blocks is evicted
            await run(eng, eng.encode(f"Story {i}: tell me about the sea and the sky and the wind. " * 4))
            if not eng.kv.match(prompt)[0]:
                break
        assert eng.kv.stats().evictions > 0 and eng.kv.match(prompt)[0] == []
        hits = eng.kv.stats().hit_tokens
        assert await run(eng, prompt) == expected
        assert eng.kv.stats().hit_tokens == hits  # nothing was left to reuse
    finally:
        eng.close()


async def test_eviction_under_pressure_never_takes_a_block_in_use(loaded: LoadedModel, fresh: Engine) -> None:
    eng = make_engine(loaded, max_batch_total_tokens=320, max_batch_size=3)
    try:
        system = system_prompt(eng)
        long_params = SamplingParams(max_new_tokens=32, ignore_eos=True)
        prompt = system + eng.encode(" Tell me everything.")
        expected = await run(fresh, prompt, long_params)
        await run(eng, prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))  # cache the prefix
        held: list[int] = []

        def check(kind: str, batch: int) -> None:
            for seq in eng.core.scheduler.running:
                assert seq.blocks is not None
                assert all(eng.kv.refs(b) >= 1 for b in seq.blocks.blocks)
            if not held and eng.core.scheduler.running:
                held.extend(eng.core.scheduler.running[0].blocks.blocks if eng.core.scheduler.running[0].blocks else [])

        eng.fault_hook = check
        churn = [eng.encode(f"Note {i}: the tide tables for the week ahead. " * 3) for i in range(6)]
        results = await asyncio.gather(run(eng, prompt, long_params), *(run(eng, c) for c in churn))
        assert results[0] == expected
        assert eng.kv.stats().evictions > 0
        assert all_blocks_back(eng)
    finally:
        eng.close()


async def test_blocks_return_to_the_pool_after_cancel_deadline_and_oom(loaded: LoadedModel) -> None:
    # 256 tokens of the tiny model take about 0.3 s: well past the 0.1 s queue timeout.
    eng = make_engine(loaded, max_batch_size=1, queue_timeout_s=0.1, max_new_tokens=256)
    try:
        system = system_prompt(eng)
        # Cancelled mid-decode (what a client's gRPC deadline does to its stream).
        stream = eng.submit([*system, 5], SamplingParams(max_new_tokens=32, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()
        await asyncio.wait_for(asyncio.to_thread(eng.drain, 5), 6)
        assert all_blocks_back(eng)
        # The engine's own deadline: a request that waits past the queue timeout.
        running = eng.submit([*system, 6], SamplingParams(max_new_tokens=256, ignore_eos=True))
        await running.__anext__()
        with pytest.raises(ResourceExhausted):
            await run(eng, [*system, 7])
        running.cancel()
        await asyncio.wait_for(asyncio.to_thread(eng.drain, 5), 6)
        assert all_blocks_back(eng)

        # Out of memory with a single row: nothing to halve, the request fails.
        def oom(kind: str, batch: int) -> None:
            if kind == "decode":
                raise torch.OutOfMemoryError("injected")

        eng.fault_hook = oom
        with pytest.raises(ResourceExhausted):
            await run(eng, [*system, 8])
        eng.fault_hook = None
        await asyncio.wait_for(asyncio.to_thread(eng.drain, 5), 6)
        assert all_blocks_back(eng)
    finally:
        eng.close()


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0
