"""The continuous-batching engine on the tiny real model (no gRPC, no mocks of torch)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from llmesh.errors import InvalidArgument, LlmeshError, ResourceExhausted
from llmesh.models import verify
from llmesh.testing import eventually, record_calls
from services.inference.engine import Engine, EngineConfig, GenerationEvent, LoadedModel
from services.inference.engine.config import MIN_PREFILL_CHUNK
from services.inference.engine.decoding import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu", "float32")  # batch invariance holds in float32


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    eng = Engine(loaded, EngineConfig(max_batch_size=8, max_prompt_tokens=256, max_new_tokens=256))
    eng.warm_up()
    eng.start()
    yield eng
    eng.close()


def side_engine(loaded: LoadedModel, **config: object) -> Engine:
    """A second engine on the same weights with its own limits (not warmed: tests only)."""
    eng = Engine(loaded, EngineConfig(**{"max_prompt_tokens": 256, "max_new_tokens": 256, **config}))  # type: ignore[arg-type]
    eng.start()
    return eng


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def run(
    engine: Engine, ids: list[int], params: SamplingParams = GREEDY
) -> tuple[list[int], str, GenerationEvent]:
    tokens: list[int] = []
    text = ""
    last = None
    async for event in engine.submit(ids, params):
        tokens += event.token_ids
        text += event.text
        last = event
    assert last is not None and last.finish_reason is not None
    return tokens, text, last


def prompts(engine: Engine) -> list[list[int]]:
    texts = ["Hi", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea " * 4, "é 🌍 ok?"]
    return [engine.encode(t) for t in texts]


async def test_joining_mid_batch_gives_the_same_greedy_tokens_as_alone(engine: Engine) -> None:
    ps = prompts(engine)
    alone = [(await run(engine, ids))[0] for ids in ps]
    long_params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    long_alone = (await run(engine, ps[2], long_params))[0]

    # A long request runs; the others join one by one while it decodes (different lengths, so
    # the cache is left-padded on merge and trimmed when rows leave).
    first = engine.submit(ps[2], long_params)
    got_long: list[int] = []
    joined = []
    async for event in first:
        got_long += event.token_ids
        if len(got_long) in (3, 10, 20):
            joined.append(asyncio.create_task(run(engine, ps[len(joined)])))
        if len(got_long) == 30:
            joined.append(asyncio.create_task(run(engine, ps[3])))
    results = await asyncio.gather(*joined)
    assert got_long == long_alone
    assert [r[0] for r in results] == [alone[0], alone[1], alone[2], alone[3]]
    # They really ran in a batch with the long one: joiners got a later batch segment.
    assert len({r[2].batch_id for r in results}) == 4
    assert engine.running_count == 0


async def test_concurrent_batch_matches_alone(engine: Engine) -> None:
    ps = prompts(engine)
    alone = [(await run(engine, ids))[0] for ids in ps]
    together = await asyncio.gather(*(run(engine, ids) for ids in ps))
    assert [t[0] for t in together] == alone
    # Submitted at once into an idle engine, they share a prefill (LLMESH_BATCH_WAIT_MS gathers
    # them); a thread switch in the middle of the submissions may split them once.
    assert len({t[2].batch_id for t in together}) <= 2


async def test_rows_leave_at_once_and_padding_columns_are_trimmed(engine: Engine) -> None:
    ps = prompts(engine)
    long_prompt, short = ps[2], ps[0]
    assert len(long_prompt) > len(short) + 10
    quick = SamplingParams(max_new_tokens=3, ignore_eos=True)
    slow = SamplingParams(max_new_tokens=30, ignore_eos=True)
    alone = (await run(engine, short, slow))[0]
    widths: list[int] = []

    def watch(kind: str, rows: int) -> None:  # on the worker, before each forward: the width it uses
        if kind == "decode":
            widths.append(engine.cache_columns)

    engine.fault_hook = watch
    try:
        together = await asyncio.gather(run(engine, long_prompt, quick), run(engine, short, slow))
    finally:
        engine.fault_hook = None
    assert together[1][0] == alone
    assert together[0][2].output_tokens == 3
    # Once the long prompt's row left, the columns only it used were dropped.
    assert max(widths) >= len(long_prompt) + 1
    assert min(w for w in widths if w) <= len(short) + 5
    assert engine.cache_columns == 0


@pytest.mark.parametrize("top_p", [1.0, 0.8])
async def test_same_seed_same_tokens_alone_and_in_a_batch(engine: Engine, top_p: float) -> None:
    ps = prompts(engine)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=top_p, seed=1234, ignore_eos=True)
    alone = (await run(engine, ps[1], params))[0]
    others = [
        SamplingParams(max_new_tokens=30, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=1.3, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.5, top_p=0.5, ignore_eos=True),
    ]
    batch = await asyncio.gather(
        run(engine, ps[0], others[0]),
        run(engine, ps[1], params),
        run(engine, ps[2], others[1]),
        run(engine, ps[3], others[2]),
    )
    assert batch[1][0] == alone
    other_seed = (await run(engine, ps[1], dataclasses.replace(params, seed=99)))[0]
    assert other_seed != alone  # sampling really samples


async def test_stream_deltas_concatenate_to_the_full_decode(engine: Engine) -> None:
    # A random model emits byte-fragment tokens often: the deltas must still never split a character.
    params = SamplingParams(max_new_tokens=80, temperature=1.5, seed=3, ignore_eos=True)
    deltas: list[str] = []
    ids: list[int] = []
    async for event in engine.submit(engine.encode("é 🌍"), params):
        deltas.append(event.text)
        ids += event.token_ids
    full = engine.model.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # a random model can emit byte tokens that are invalid UTF-8 in any split
        assert all("\ufffd" not in d for d in deltas[:-1])


async def test_stop_string_ends_the_text_before_it(engine: Engine) -> None:
    ids = engine.encode("Once upon a time")
    _, full, _ = await run(engine, ids, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert len(full) > 20
    stop = full[10:14]
    cut = full.find(stop)
    tokens, text, last = await run(engine, ids, SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(stop,)))
    assert last.finish_reason == "stop_sequence"
    assert text == full[:cut]
    assert last.output_tokens == len(tokens) < 40


async def test_cancelled_stream_frees_its_row_within_a_step(engine: Engine) -> None:
    before_cancelled = sample("llmesh_inference_requests_total", {"outcome": "cancelled"})
    stream = engine.submit(engine.encode("Hello"), SamplingParams(max_new_tokens=256, ignore_eos=True))
    await stream.__anext__()
    await stream.__anext__()
    assert engine.running_count == 1
    steps = engine.steps
    await stream.aclose()
    await eventually(lambda: engine.running_count == 0, 5.0)
    assert engine.steps - steps <= 2
    assert sample("llmesh_inference_batch_size") == 0
    assert sample("llmesh_inference_requests_total", {"outcome": "cancelled"}) == before_cancelled + 1


async def test_task_cancellation_cancels_the_sequence(engine: Engine) -> None:
    async def consume() -> None:
        async for _ in engine.submit(engine.encode("Hello"), SamplingParams(max_new_tokens=256, ignore_eos=True)):
            pass

    task = asyncio.create_task(consume())
    await eventually(lambda: engine.running_count == 1, 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: engine.running_count == 0, 5.0)


async def test_full_queue_is_refused_at_once(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=1, max_queue=2)
    try:
        long = SamplingParams(max_new_tokens=200, ignore_eos=True)
        ids = eng.encode("Hello")
        running = eng.submit(ids, long)
        await running.__anext__()
        queued = [eng.submit(ids, long) for _ in range(2)]
        rejected_before = sample("llmesh_inference_requests_total", {"outcome": "rejected_queue_full"})
        # At once: `submit` is no coroutine, so raising here is refusing without waiting for a
        # place in the queue.
        with pytest.raises(ResourceExhausted) as info:
            eng.submit(ids, long)
        assert info.value.retry_after > 0 and info.value.reason == "QUEUE_FULL"
        assert sample("llmesh_inference_requests_total", {"outcome": "rejected_queue_full"}) == rejected_before + 1
        for s in [running, *queued]:
            s.cancel()
    finally:
        eng.close()


async def test_queue_timeout(loaded: LoadedModel) -> None:
    # 256 tokens of the tiny model take about 0.3 s with the own decode forward: well past 0.1 s.
    eng = side_engine(loaded, max_batch_size=1, queue_timeout_s=0.1)
    try:
        ids = eng.encode("Hello")
        running = eng.submit(ids, SamplingParams(max_new_tokens=256, ignore_eos=True))
        await running.__anext__()
        with pytest.raises(ResourceExhausted) as info:
            await run(eng, ids)
        assert info.value.reason == "QUEUE_TIMEOUT"
        assert "LLMESH_QUEUE_TIMEOUT_SECONDS" in info.value.message
        running.cancel()
    finally:
        eng.close()


async def test_kv_blocks_limit_admission(loaded: LoadedModel) -> None:
    # 4 blocks of 16 tokens: a request (3 prompt + 20 new tokens) ends holding 2. Admission
    # keeps a block per running row for it to grow into, so two run and the third waits for
    # blocks (not for a row: there are 8), then runs.
    ids = [1, *loaded.encode("Hello there")]
    assert len(ids) < 16
    eng = side_engine(loaded, max_batch_size=8, max_batch_total_tokens=64, max_prompt_tokens=16, max_new_tokens=20)
    try:
        assert eng.kv.usable_blocks == 4 and eng.max_total_tokens == 64
        load = eng.load()
        assert (load.kv_blocks_total, load.kv_blocks_free, load.block_tokens, load.max_running) == (4, 4, 16, 8)
        params = SamplingParams(max_new_tokens=20, ignore_eos=True)
        seen: list[int] = []

        def watch(kind: str, rows: int) -> None:  # on the worker, before each forward
            seen.append(eng.running_count)

        eng.fault_hook = watch
        results = await asyncio.gather(*(run(eng, ids, params) for _ in range(3)))
        eng.fault_hook = None
        assert max(seen) == 2
        assert all(r[2].finish_reason == "length" for r in results)
        assert eng.preemptions == 0
        assert eng.load().kv_blocks_free == 4
    finally:
        eng.close()


async def test_a_row_preempted_for_blocks_resumes_with_the_same_tokens(loaded: LoadedModel) -> None:
    # 3 blocks: two rows start (one block each, one kept free), both need a second block at
    # their 16th token and only one is left: the newest row is requeued and resumes later,
    # prefilled again with what it had generated.
    ids = [1, *loaded.encode("Hello there")]
    eng = side_engine(loaded, max_batch_size=8, max_batch_total_tokens=48, max_prompt_tokens=16, max_new_tokens=30)
    try:
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        other = [1, *loaded.encode("Tell me")]
        alone = [(await run(eng, p, params))[0] for p in (ids, other)]
        together = await asyncio.gather(run(eng, ids, params), run(eng, other, params))
        assert eng.preemptions >= 1
        assert [t[0] for t in together] == alone
        assert eng.load().kv_blocks_free == 3
    finally:
        eng.close()


async def test_invalid_requests_are_refused_before_queueing(engine: Engine) -> None:
    with pytest.raises(InvalidArgument) as info:
        engine.submit(list(range(1, 300)), GREEDY)
    assert "LLMESH_MAX_PROMPT_TOKENS" in info.value.message and "256" in info.value.message
    with pytest.raises(InvalidArgument):
        engine.submit([1, 2], SamplingParams(max_new_tokens=257))
    assert engine.waiting_count == 0


async def test_out_of_memory_halves_the_batch_and_loses_nothing(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=8)
    ps = prompts(eng)
    alone = [(await run(eng, ids))[0] for ids in ps]
    failures = {"decode": 1, "prefill": 1}

    def fail_once(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        # Raised inside the forward, after layer 0 already appended this step's KV column:
        # the engine must take that column back before retrying.
        hidden = args[0]
        kind = "decode" if hidden.shape[1] == 1 else "prefill"
        if hidden.shape[0] >= 2 and failures[kind] > 0 and (kind == "prefill" or eng.steps >= 5):
            failures[kind] -= 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")

    handle = loaded.model.model.layers[1].register_forward_pre_hook(fail_once)
    if eng.runner.fast is not None:  # the own Llama forward (llama.py) runs no HF layer
        eng.runner.fast.before_layer = lambda index, hidden: fail_once(loaded.model, (hidden,)) if index == 1 else None
    try:
        before = sample("llmesh_inference_oom_retries_total")
        together = await asyncio.gather(*(run(eng, ids) for ids in ps))
        assert [t[0] for t in together] == alone
        assert sample("llmesh_inference_oom_retries_total") == before + 2
        assert failures == {"decode": 0, "prefill": 0}
    finally:
        handle.remove()
        eng.close()


async def test_step_failure_fails_the_batch_and_keeps_serving(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=4)
    try:
        ids = eng.encode("Hello")

        def hook(kind: str, batch: int) -> None:
            raise RuntimeError("boom")

        eng.fault_hook = hook
        with pytest.raises(LlmeshError):
            await run(eng, ids)
        eng.fault_hook = None
        tokens, _, last = await run(eng, ids)
        assert last.finish_reason == "length" and len(tokens) == GREEDY.max_new_tokens
    finally:
        eng.close()


class WorkerDeath(BaseException):
    """Not an Exception: escapes the per-step handler, as a bug in the loop itself would."""


async def test_a_dead_worker_closes_the_engine(loaded: LoadedModel) -> None:
    from llmesh.errors import Unavailable

    eng = side_engine(loaded, max_batch_size=1)
    dead: list[Engine] = []
    eng.on_dead.append(dead.append)
    try:
        ids = eng.encode("Hello")
        running = eng.submit(ids, SamplingParams(max_new_tokens=200, ignore_eos=True))
        await running.__anext__()
        waiting = eng.submit(ids, GREEDY)
        assert eng.waiting_count == 1

        def die(kind: str, batch: int) -> None:
            raise WorkerDeath("injected")

        eng.fault_hook = die
        for stream in (running, waiting):
            with pytest.raises(Unavailable):
                async for _ in stream:
                    pass
        assert eng.closed and eng.dead and dead == [eng]
        assert eng.waiting_count == 0 and eng.running_count == 0
        with pytest.raises(Unavailable):
            eng.submit(ids, GREEDY)
    finally:
        eng.close()


async def test_requeued_after_oom_then_a_failure_are_served_not_orphaned(loaded: LoadedModel) -> None:
    eng = side_engine(loaded, max_batch_size=8, batch_wait_s=0.5)
    ps = prompts(eng)
    alone = [(await run(eng, ids))[0] for ids in ps]
    probe = SamplingParams(max_new_tokens=4, ignore_eos=True)
    steps = eng.steps
    await run(eng, ps[0], probe)
    probe_steps = eng.steps - steps  # what one probe costs an idle engine
    calls: list[int] = []

    def hook(kind: str, batch: int) -> None:
        if kind != "prefill" or len(calls) >= 2:
            return
        calls.append(batch)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")  # split 4 -> 2 + 2 requeued
        raise RuntimeError("boom")  # the retried half fails

    eng.fault_hook = hook
    try:
        results = await asyncio.gather(*(run(eng, ids) for ids in ps), return_exceptions=True)
        assert calls == [4, 2]
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 2 and all(isinstance(f, LlmeshError) for f in failed)
        # The requeued half ran for real, to the end, with the right tokens.
        served = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
        assert [i for i, _ in served] == [2, 3]
        assert [r[0] for _, r in served] == [alone[2], alone[3]]
        # Nothing left behind: the worker goes idle (nothing queued or running), and a probe
        # served after that costs exactly the steps it costs alone (no row steps beside it).
        assert await asyncio.to_thread(eng.drain, 10.0)
        steps = eng.steps
        await run(eng, ps[0], probe)
        assert eng.steps - steps == probe_steps
        assert eng.running_count == 0 and eng.waiting_count == 0
    finally:
        eng.close()


async def test_steps_and_submit_do_not_wait_for_the_emitter(loaded: LoadedModel) -> None:
    # Detokenization, spans and delivery run on the emitter thread, which holds no lock the
    # worker or submit need: with the emitter stuck, the worker keeps stepping and submit answers.
    import threading

    eng = side_engine(loaded, max_batch_size=4)
    stuck = threading.Event()
    release = threading.Event()
    unstuck = threading.Event()  # the stuck flush went on (released, or its own wait ran out)
    original = eng.core.output._flush

    def blocking_flush() -> None:
        stuck.set()
        release.wait(60)
        unstuck.set()
        original()

    eng.core.output._flush = blocking_flush  # type: ignore[method-assign]
    try:
        ids = eng.encode("Hello")
        first = asyncio.create_task(run(eng, ids, SamplingParams(max_new_tokens=40, ignore_eos=True)))
        await asyncio.to_thread(stuck.wait, 10)
        steps = eng.steps
        second = eng.submit(ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
        await eventually(lambda: eng.steps >= steps + 5, 30.0, message="the worker stopped stepping")
        # Both while the emitter was still stuck: neither waited for it.
        assert not unstuck.is_set()
        release.set()
        tokens, _, last = await first
        assert len(tokens) == 40 and last.finish_reason == "length"
        got = [e async for e in second]
        assert got[-1].finish_reason == "length"
    finally:
        release.set()
        eng.close()


def test_one_host_copy_per_decode_step(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Sampling rows included: the draws are hashed on the device, no CPU generator, no .item().
    # The nucleus as on an accelerator (a full sort): on the CPU it first looks among the
    # likeliest tokens and checks their mass, a read that is no copy where device and host are one.
    from services.inference.engine import sampling as sampling_module
    from services.inference.engine.runner import ModelRunner

    monkeypatch.setattr(sampling_module, "NUCLEUS_CANDIDATES", 10**9)

    runner = ModelRunner(loaded, 16, 16, 64, (1, 2, 4), cuda_graphs=False)
    prompt = loaded.encode("Hello there")
    tables = [[1], [2], [3]]
    with torch.inference_mode():
        runner.prefill([(prompt, 0, t) for t in tables])
    copies: list[str] = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _n: str = name, _o: object = original, **k: object) -> object:
            copies.append(_n)
            return _o(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    rows = [(5, len(prompt), tables[0]), (6, len(prompt), tables[1]), (7, len(prompt), tables[2])]
    sampling = ([1, 2], [0.8, 1.2], [0.9, 1.0], [11, 12], [1, 1])
    with torch.inference_mode():
        tokens = runner.decode(rows, sampling)
    monkeypatch.undo()
    assert copies == ["tolist"]
    assert len(tokens) == 3


async def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(loaded: LoadedModel) -> None:
    # No prefix cache: the long prompt ran alone first, and is to be prefilled again in chunks.
    eng = side_engine(loaded, max_batch_size=4, max_prompt_tokens=512, prefix_caching=False)
    ps = prompts(eng)
    long_prompt = eng.encode("Tell me about the sea, the sky and everything in between. " * 36)
    assert len(long_prompt) > 3 * 128
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    try:
        short_alone = (await run(eng, ps[1], SamplingParams(max_new_tokens=60, ignore_eos=True)))[0]
        long_alone = (await run(eng, long_prompt, params))[0]
        # Make one decode step look as long as 40 prefill tokens: a chunk is then the smallest
        # chunk, 128 tokens (the engine re-measures as it goes; the hook resets the figures).
        prefills: list[int] = []
        steps_between: list[int] = []

        def hook(kind: str, batch: int) -> None:
            if kind == "prefill":
                prefills.append(eng.steps)
            eng.core.speeds.prefill_tok_s, eng.core.speeds.step_s = 4000.0, 0.01

        eng.fault_hook = hook
        short = eng.submit(ps[1], SamplingParams(max_new_tokens=60, ignore_eos=True))
        got_short: list[int] = []
        long_task = None
        async for event in short:
            got_short += event.token_ids
            if len(got_short) == 2:
                prefills.clear()
                long_task = asyncio.create_task(run(eng, long_prompt, params))
        assert long_task is not None
        got_long = (await long_task)[0]
        assert got_short == short_alone and got_long == long_alone
        chunks = len(prefills)
        assert chunks >= len(long_prompt) // MIN_PREFILL_CHUNK
        steps_between = [b - a for a, b in itertools.pairwise(prefills)]
        assert steps_between and all(s == 1 for s in steps_between)  # one decode step after each chunk
    finally:
        eng.close()


async def test_a_bf16_model_serves_through_the_same_blocks_and_buckets(tiny_model: Path) -> None:
    model = LoadedModel(verify(tiny_model), "cpu")
    model.model.to(torch.bfloat16)
    # Cast by hand, as the hardware rule does on a CPU with native bf16 (this one may have none).
    model.dtype, model.dtype_name = torch.bfloat16, "bfloat16"
    eng = Engine(model, EngineConfig(max_batch_size=4, max_prompt_tokens=64, max_new_tokens=32, decode_buckets=(2, 4)))
    eng.warm_up()
    eng.start()
    try:
        assert eng.runner.kv.keys[0].dtype == torch.bfloat16 and eng.description.dtype == "bfloat16"
        ps = prompts(eng)
        alone = (await run(eng, ps[1]))[0]
        sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=5, ignore_eos=True)
        results = await asyncio.gather(*(run(eng, ids) for ids in ps), run(eng, ps[0], sampled))
        assert all(r[2].finish_reason == "length" for r in results)
        assert [len(r[0]) for r in results] == [GREEDY.max_new_tokens] * 4 + [10]
        assert results[1][0][:2] == alone[:2]  # bf16: batch shapes may flip near ties later on
    finally:
        eng.close()


async def test_reused_blocks_and_padded_buckets_keep_every_row_equal_to_its_solo_run(loaded: LoadedModel) -> None:
    # 4 rows, decode buckets 2 and 4 (padding rows whenever 3 run); 10 requests of different
    # lengths arriving staggered, so rows leave and newcomers take the freed blocks (stale
    # tokens of the last owner in them). No prefix cache: every block is written afresh.
    eng = side_engine(loaded, max_batch_size=4, decode_buckets=(2, 4), prefix_caching=False)
    texts = [f"Request {i}: " + "tell me about the sea " * (i % 4) for i in range(10)]
    ps = [eng.encode(t) for t in texts]
    news = [6 + 5 * (i % 3) for i in range(10)]
    owners: dict[int, set[int]] = {}
    batches: set[int] = set()

    def record(kind: str, batch: int) -> None:
        if kind == "decode":
            for seq in eng.core.scheduler.running:
                assert seq.blocks is not None
                for block in seq.blocks.blocks:
                    owners.setdefault(block, set()).add(seq.seq_id)
            batches.add(eng.runner.bucket(len(eng.core.scheduler.running)) - len(eng.core.scheduler.running))

    try:
        alone = [
            (await run(eng, ids, SamplingParams(max_new_tokens=n, ignore_eos=True)))[0]
            for ids, n in zip(ps, news, strict=True)
        ]
        eng.fault_hook = record
        start = eng.steps

        async def later(i: int) -> list[int]:
            # Arrivals paced by the engine's own steps: request i joins after 3 * i of them, while
            # earlier ones (6 to 16 new tokens each) are still running.
            await eventually(lambda: eng.steps >= start + 3 * i, 30.0)
            return (await run(eng, ps[i], SamplingParams(max_new_tokens=news[i], ignore_eos=True)))[0]

        together = await asyncio.gather(*(later(i) for i in range(10)))
        assert together == alone
        assert any(len(ids) >= 2 for ids in owners.values()), owners  # blocks were reused
        assert max(batches) >= 1  # some steps ran padding rows
    finally:
        eng.close()


async def test_prompt_chunks_ride_in_the_decode_step(loaded: LoadedModel) -> None:
    # While rows decode, a long prompt's chunks go through the same forward as the decode rows
    # (one forward per iteration), never as a separate prefill forward.
    eng = side_engine(loaded, max_batch_size=4, max_prompt_tokens=512, prefix_caching=False)
    long_prompt = eng.encode("Tell me about the sea, the sky and everything in between. " * 36)
    forwards = record_calls(eng.runner, ("prefill", "mixed", "decode"))

    def hook(kind: str, batch: int) -> None:
        eng.core.speeds.prefill_tok_s, eng.core.speeds.step_s = 4000.0, 0.01  # chunks of the smallest size, 128

    try:
        eng.fault_hook = hook
        short = eng.submit(prompts(eng)[1], SamplingParams(max_new_tokens=60, ignore_eos=True))
        got = 0
        long_task = None
        async for event in short:
            got += len(event.token_ids)
            if got == 2:
                forwards.clear()
                long_task = asyncio.create_task(
                    run(eng, long_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
                )
        assert long_task is not None
        await long_task
        assert forwards.count("mixed") >= len(long_prompt) // MIN_PREFILL_CHUNK
        assert "prefill" not in forwards
    finally:
        eng.close()
