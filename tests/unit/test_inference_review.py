"""Findings of the review of the engine, each pinned by a test: the idle flag and a
request arriving meanwhile, a worker dying while a prefill group is taken, a stop string found
only when the decoder flushes, 64-bit seeds, the EOS token counted and sent, and a row whose
stop fired not prefilled again after an out-of-memory split."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from llmesh.errors import Unavailable
from llmesh.models import verify
from services.inference.engine import Engine, EngineConfig, GenerationEvent, LoadedModel
from services.inference.engine.decoding import IncrementalDecoder, SamplingParams, StopMatcher, resolve_params
from services.inference.engine.messages import TokenItem, Tokens
from services.inference.engine.output import Emitter
from services.inference.engine.sequence import SequenceState, Sink


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu", "float32")


def side_engine(loaded: LoadedModel, **config: object) -> Engine:
    values: dict[str, object] = {"max_batch_size": 4, "max_prompt_tokens": 64, "max_new_tokens": 256, **config}
    eng = Engine(loaded, EngineConfig(**values))  # type: ignore[arg-type]
    eng.start()
    return eng


async def collect(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[list[int], GenerationEvent]:
    tokens: list[int] = []
    last = None
    async for event in engine.submit(ids, params):
        tokens += event.token_ids
        last = event
    assert last is not None
    return tokens, last


async def test_a_request_arriving_while_the_worker_goes_idle_keeps_the_engine_busy(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker checks for work between submit marking the engine busy and the request
    # entering the queue: the engine must not read as idle (a model switch would close it and
    # fail the request) while the request waits.
    eng = side_engine(loaded)
    try:
        original = eng.core.inbox.submit

        def submit_after_an_idle_check(*args: object, **kwargs: object) -> None:
            eng.core.inbox.wake()
            eng.drain(2.0)  # the worker has looked, found nothing, and gone idle
            original(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(eng.core.inbox, "submit", submit_after_an_idle_check)
        stream = eng.submit(eng.encode("Hello"), SamplingParams(max_new_tokens=200, ignore_eos=True))
        assert not eng.drain(0)
        stream.cancel()
    finally:
        eng.close()


class WorkerDeath(BaseException):
    """Not an Exception: escapes the per-step handler, as a bug in the loop itself would."""


async def test_a_worker_dying_with_a_prefill_group_taken_ends_its_streams(loaded: LoadedModel) -> None:
    eng = side_engine(loaded)
    try:

        def die(kind: str, batch: int) -> None:
            if kind == "prefill":
                raise WorkerDeath("injected")

        eng.fault_hook = die
        ids = eng.encode("Hello")
        streams = [eng.submit(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)) for _ in range(2)]

        async def drain(stream: object) -> None:
            async for _ in stream:  # type: ignore[attr-defined]
                pass

        for stream in streams:
            with pytest.raises(Unavailable):
                await asyncio.wait_for(drain(stream), 5)  # not at the request's deadline
        assert eng.dead
    finally:
        eng.close()


def test_a_stop_string_completed_by_the_flush_is_reported_as_the_stop(loaded: LoadedModel) -> None:
    # A byte token that starts a UTF-8 character is held back by the decoder until the next
    # token; at the length limit it is flushed (as U+FFFD), completing the stop string there.
    tokenizer = loaded.tokenizer
    partial = tokenizer.token_to_id("Ã")
    assert tokenizer.decode([partial]) == "\ufffd"
    params = resolve_params(SamplingParams(max_new_tokens=2, stop=("\ufffd",), ignore_eos=True), [1], _limits(loaded))
    seq = SequenceState(
        prompt_ids=[1],
        params=params,
        request_id="",
        sink=Sink(None),
        decoder=IncrementalDecoder(tokenizer),
        stopper=StopMatcher(params.stop),
        seed=0,
        enqueued_at=time.monotonic(),
        internal=True,
    )
    emitter = Emitter("review", "tiny", "v1", tokenizer)
    try:
        emitter.put(Tokens(time.monotonic(), [TokenItem(seq, tokenizer.token_to_id("a"))]))
        emitter.put(Tokens(time.monotonic(), [TokenItem(seq, partial, "length")]))
        emitter.sync()
    finally:
        emitter.stop()
    last = seq.sink.items[-1]
    assert isinstance(last, GenerationEvent)
    assert last.finish_reason == "stop_sequence" and "\ufffd" not in last.text


def _limits(loaded: LoadedModel):  # type: ignore[no-untyped-def]
    from services.inference.engine.decoding import Limits

    return Limits(
        max_prompt_tokens=64,
        max_new_tokens=64,
        default_max_new_tokens=16,
        max_context_tokens=256,
        vocab_size=loaded.vocab_size,
    )


async def test_seeds_keep_all_64_bits(loaded: LoadedModel) -> None:
    eng = side_engine(loaded)
    try:
        ids = eng.encode("Once upon a time")

        def params(seed: int) -> SamplingParams:
            return SamplingParams(max_new_tokens=24, temperature=1.5, seed=seed, ignore_eos=True)

        low, _ = await collect(eng, ids, params(5))
        high, _ = await collect(eng, ids, params(5 + (1 << 63)))
        top, _ = await collect(eng, ids, params((1 << 64) - 1))
        assert low != high  # the top bit is part of the seed, not cut off
        assert len(top) == 24
        again, _ = await collect(eng, ids, params(5 + (1 << 63)))
        assert again == high
    finally:
        eng.close()


async def test_the_eos_token_is_sent_as_it_is_counted(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = side_engine(loaded)
    try:
        ids = eng.encode("Once upon a time")
        greedy, _ = await collect(eng, ids, SamplingParams(max_new_tokens=8, ignore_eos=True))
        eos = greedy[3]
        first = greedy.index(eos)
        # The scheduler's stop check holds the model's EOS set from the engine's start.
        monkeypatch.setattr(eng.core.scheduler, "eos_ids", frozenset({eos}))
        tokens, last = await collect(eng, ids, SamplingParams(max_new_tokens=8))
        assert last.finish_reason == "stop"
        assert tokens == greedy[: first + 1]
        assert last.output_tokens == len(tokens)
    finally:
        eng.close()


async def test_a_row_whose_stop_fired_is_not_prefilled_again_after_an_oom_split(loaded: LoadedModel) -> None:
    import torch

    eng = side_engine(loaded, max_batch_size=2)
    try:
        ids = eng.encode("Hello")
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        events: list[str] = []

        def hook(kind: str, batch: int) -> None:
            events.append(f"{kind}:{batch}")
            if kind == "decode" and batch == 2 and "oom" not in events:
                # The newest row's stop string was found (by the emitter) just before this step,
                # which runs out of memory: the split requeues that row.
                eng.core.scheduler.running[-1].stop_hit = True
                events.append("oom")
                raise torch.OutOfMemoryError("injected")

        first = eng.submit(ids, params)
        await first.__anext__()
        await first.__anext__()
        eng.fault_hook = hook
        second = eng.submit(ids, params)
        tokens = [t async for e in first for t in e.token_ids]
        assert len(tokens) == 38  # the first row went on to its end
        assert "oom" in events
        assert not any(e.startswith("prefill") for e in events[events.index("oom") :])
        second.cancel()
    finally:
        eng.close()
