"""Priority in the builtin engine: interactive requests (priority 0) are served before batch
requests (priority 1), and take a batch row's row or KV blocks when they need them. The
preempted batch row is requeued, keeps its computed prefix in the prefix cache, and resumes to
the same greedy tokens it would have produced alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from llmesh.models import verify
from llmesh.testing import eventually
from services.inference.engine import Engine, EngineConfig, LoadedModel
from services.inference.engine.decoding import SamplingParams
from services.inference.engine.sequence import PRIORITY_BATCH, PRIORITY_INTERACTIVE

LONG = SamplingParams(max_new_tokens=48, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu", "float32")


def side_engine(loaded: LoadedModel, **config: object) -> Engine:
    eng = Engine(loaded, EngineConfig(**{"max_prompt_tokens": 64, "max_new_tokens": 64, **config}))  # type: ignore[arg-type]
    eng.start()
    return eng


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def run(
    engine: Engine, ids: list[int], params: SamplingParams, priority: int, order: list[str], name: str
) -> list[int]:
    tokens: list[int] = []
    async for event in engine.submit(ids, params, priority=priority):
        tokens += event.token_ids
    order.append(name)
    return tokens


async def started(
    engine: Engine, ids: list[int], params: SamplingParams, priority: int, tokens: int
) -> tuple[asyncio.Task[list[int]], asyncio.Event]:
    """A request running in the background; the event is set once it has `tokens` tokens."""
    got = asyncio.Event()

    async def go() -> list[int]:
        out: list[int] = []
        async for event in engine.submit(ids, params, priority=priority):
            out += event.token_ids
            if len(out) >= tokens:
                got.set()
        return out

    return asyncio.create_task(go()), got


async def test_an_interactive_request_takes_a_batch_row_when_every_row_is_busy(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=2)
    try:
        a, b, c = ([1, *loaded.encode(t)] for t in ("Summarise the report", "List the files", "Hello there"))
        alone = [(await run(eng, p, LONG, PRIORITY_BATCH, [], "")) for p in (a, b)]
        assert eng.drain(30.0)  # the worker is idle: its blocks are the test's to touch
        eng.kv.forget_cached()  # the resumed rows must reuse what they computed themselves
        hits_before = sample("llmesh_inference_prefix_hit_tokens_total")
        before = sample("llmesh_inference_preemptions_total", {"reason": "priority"})
        # Two batch rows fill the batch and have each computed more than a block of tokens.
        first, first_going = await started(eng, a, LONG, PRIORITY_BATCH, 20)
        second, second_going = await started(eng, b, LONG, PRIORITY_BATCH, 20)
        await first_going.wait()
        await second_going.wait()
        order: list[str] = []
        interactive = await run(eng, c, SHORT, PRIORITY_INTERACTIVE, order, "interactive")
        assert len(interactive) == 4
        assert not first.done() and not second.done()  # it did not wait for a batch row to end
        assert [await first, await second] == alone  # the preempted row resumed to the same tokens
        assert sample("llmesh_inference_preemptions_total", {"reason": "priority"}) == before + 1
        assert eng.preemptions >= 1
        # The preempted row resumed from its cached prefix rather than from nothing.
        assert sample("llmesh_inference_prefix_hit_tokens_total") - hits_before >= eng.kv.block_tokens
    finally:
        eng.close()


async def test_an_interactive_request_takes_a_batch_rows_kv_blocks(loaded: LoadedModel) -> None:
    # 3 blocks of 16 tokens: two batch rows hold one each and the one left is kept for them to
    # grow into, so a third request finds no blocks; rows are plenty (8).
    eng = side_engine(loaded, max_batch_size=8, max_batch_total_tokens=48, max_prompt_tokens=16, max_new_tokens=30)
    try:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        a, b = [1, *loaded.encode("Hello there")], [1, *loaded.encode("Tell me")]
        alone = [(await run(eng, p, params, PRIORITY_BATCH, [], "")) for p in (a, b)]
        before = sample("llmesh_inference_preemptions_total", {"reason": "priority"})
        first, first_going = await started(eng, a, params, PRIORITY_BATCH, 1)
        second, second_going = await started(eng, b, params, PRIORITY_BATCH, 1)
        await first_going.wait()
        await second_going.wait()
        interactive = await run(eng, [1, *loaded.encode("Hi")], SHORT, PRIORITY_INTERACTIVE, [], "")
        assert len(interactive) == 4
        assert [await first, await second] == alone
        assert sample("llmesh_inference_preemptions_total", {"reason": "priority"}) >= before + 1
        assert eng.load().kv_blocks_free == 3
    finally:
        eng.close()


async def test_waiting_interactive_requests_go_before_waiting_batch_requests(loaded: LoadedModel) -> None:
    # One row: while it is busy, batch requests queue up first and an interactive one after
    # them; the interactive one is served next, before any queued batch request.
    eng = side_engine(loaded, max_batch_size=1)
    try:
        order: list[str] = []
        ids = [1, *loaded.encode("Hello there")]
        running, going = await started(eng, ids, LONG, PRIORITY_INTERACTIVE, 1)
        await going.wait()
        queued = [asyncio.create_task(run(eng, ids, SHORT, PRIORITY_BATCH, order, f"batch{i}")) for i in range(3)]
        await eventually(lambda: eng.waiting_count >= 3, 30.0)
        last = asyncio.create_task(run(eng, ids, SHORT, PRIORITY_INTERACTIVE, order, "interactive"))
        await asyncio.gather(running, last, *queued)
        assert order[0] == "interactive"
        assert order[1:] == ["batch0", "batch1", "batch2"]  # first come, first served within a priority
    finally:
        eng.close()


async def test_equal_priorities_preempt_nobody_for_a_row(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=1)
    try:
        ids = [1, *loaded.encode("Hello there")]
        before = sample("llmesh_inference_preemptions_total", {"reason": "priority"})
        order: list[str] = []
        first, going = await started(eng, ids, LONG, PRIORITY_BATCH, 1)
        await going.wait()
        await asyncio.gather(first, run(eng, ids, SHORT, PRIORITY_BATCH, order, "second"))
        assert sample("llmesh_inference_preemptions_total", {"reason": "priority"}) == before
    finally:
        eng.close()


async def test_batch_rows_beside_interactive_work_are_held_to_their_cap(loaded: LoadedModel) -> None:
    """Batch work fills every row while it is alone; once an interactive request arrives, batch
    rows past `batch_rows_beside_interactive` are preempted (each step on a CPU grows with its
    rows, the interactive request's first token too) and resume later to the same tokens."""
    eng = side_engine(loaded, max_batch_size=8, batch_rows_beside_interactive=1)
    try:
        prompts = [[1, *loaded.encode(t)] for t in ("Summarise the report", "List the files", "Tell me", "Why")]
        alone = [(await run(eng, p, LONG, PRIORITY_BATCH, [], "")) for p in prompts]
        assert eng.drain(30.0)
        before = sample("llmesh_inference_preemptions_total", {"reason": "priority"})
        batch = [await started(eng, p, LONG, PRIORITY_BATCH, 2) for p in prompts]
        for _, going in batch:
            await going.wait()
        assert eng.load().running == eng.load().running_batch == 4  # alone, batch work takes every row it needs
        interactive = await run(eng, [1, *loaded.encode("Hi")], SHORT, PRIORITY_INTERACTIVE, [], "")
        assert len(interactive) == 4
        assert sample("llmesh_inference_preemptions_total", {"reason": "priority"}) >= before + 3
        assert [await task for task, _ in batch] == alone
    finally:
        eng.close()
