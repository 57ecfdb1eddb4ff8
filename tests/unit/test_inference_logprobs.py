"""Token log probabilities (SamplingParams.logprobs / top_logprobs) in the builtin engine: of the
distribution each token is drawn from (after temperature, penalties and biases, before top-k /
top-p / min-p and grammar masks), only for the rows that ask, with each token's text and bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from llmesh.errors import InvalidArgument
from llmesh.models import verify
from services.inference.engine import Engine, EngineConfig, GenerationEvent, LoadedModel
from services.inference.engine.decoding import SamplingParams, TokenPieces
from services.inference.engine.sampling import Adjustments, LogprobRows, RowAdjustment, choose, choose_scored

VOCAB = 512


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_get_the_log_softmax_of_their_logits_and_the_chosen_token_is_the_likeliest() -> None:
    logits = random_logits(3)
    asked = LogprobRows(rows=(0, 2), temperatures=(1.0, 1.0), top=(5, 0))
    chosen, scores = choose_scored(logits.clone(), [], [], [], [], [], None, None, asked)
    assert scores is not None
    reference = torch.log_softmax(logits, dim=-1)
    assert set(scores.rows) == {0, 2}  # row 1 did not ask
    for row in (0, 2):
        got = scores.rows[row]
        assert got.token_id == int(chosen[row]) == int(reference[row].argmax())
        assert got.logprob == pytest.approx(float(reference[row].max()), abs=1e-6)
    top = scores.rows[0].top
    assert len(top) == 5 and scores.rows[2].top == ()
    assert [t for t, _ in top] == reference[0].topk(5).indices.tolist()
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(reference[0].topk(5).values.tolist(), abs=1e-6)
    assert top[0][0] == scores.rows[0].token_id  # greedy: the chosen token heads the list


def test_a_greedy_token_that_ties_with_others_heads_its_alternatives() -> None:
    # A flat distribution (random weights, bfloat16 logits) ties often; topk orders equal values
    # arbitrarily, while argmax takes the lowest id. The list must still start with the token taken.
    logits = torch.zeros(2, VOCAB)
    tied = [3, 7, 100, 300, 411]
    logits[:, tied] = 4.0
    asked = LogprobRows(rows=(0, 1), temperatures=(1.0, 1.0), top=(2, 3))  # fewer places than ties
    chosen, scores = choose_scored(logits.clone(), [], [], [], [], [], None, None, asked)
    assert scores is not None
    for row in (0, 1):
        got = scores.rows[row]
        assert got.token_id == int(chosen[row]) == 3
        assert got.top[0] == (3, pytest.approx(got.logprob))
        assert {t for t, _ in got.top} <= set(tied)
    replaced = scores.get(1, 300)  # a grammar's closing path took another of the tied tokens
    assert replaced is not None and replaced.top[0][0] == 300 and len(replaced.top) == 3


def test_asking_changes_no_token_and_a_batch_that_does_not_ask_gets_none() -> None:
    logits = random_logits(4, seed=1)
    sampling = ([1, 3], [0.8, 1.3], [0.9, 1.0], [7, 8], [2, 2])
    plain = choose(logits.clone(), *sampling)
    asked = LogprobRows(rows=(1, 2), temperatures=(0.8, 1.0), top=(3, 20))
    chosen, scores = choose_scored(logits.clone(), *sampling, None, None, asked)
    assert torch.equal(chosen, plain)
    assert scores is not None
    assert choose_scored(logits.clone(), *sampling)[1] is None
    # A sampled row: the distribution at its temperature.
    tempered = torch.log_softmax(logits[1] / 0.8, dim=-1)
    assert scores.rows[1].logprob == pytest.approx(float(tempered[int(chosen[1])]), abs=1e-5)
    assert len(scores.rows[2].top) == 20


def test_biases_count_and_grammar_masks_and_top_k_do_not() -> None:
    logits = random_logits(1, seed=2)
    favourite = int(logits[0].argmin())
    bias = Adjustments((RowAdjustment(row=0, bias=((favourite, 100.0),)),), {0: (2, 0.0)})
    # The grammar allows only token 7 (bit 7 of word 0): it is chosen, but the biased token,
    # masked out, still leads the alternatives with its (biased) probability.
    bitmask = torch.zeros((1, VOCAB // 32), dtype=torch.int32)
    bitmask[0, 0] = 1 << 7
    asked = LogprobRows(rows=(0,), temperatures=(1.0,), top=(2,))
    chosen, scores = choose_scored(logits.clone(), [0], [1.0], [1.0], [3], [0], ([0], bitmask), bias, asked)
    assert scores is not None
    biased = logits[0].clone()
    biased[favourite] += 100.0
    reference = torch.log_softmax(biased, dim=-1)
    assert int(chosen[0]) == 7
    assert scores.rows[0].token_id == 7
    assert scores.rows[0].logprob == pytest.approx(float(reference[7]), abs=1e-4)
    assert scores.rows[0].top[0][0] == favourite


def test_a_token_the_caller_replaces_gets_its_own_log_probability() -> None:
    logits = random_logits(2, seed=3)
    asked = LogprobRows(rows=(1,), temperatures=(1.0,), top=(1,))
    _, scores = choose_scored(logits.clone(), [], [], [], [], [], None, None, asked)
    assert scores is not None
    replaced = scores.get(1, 42)
    assert replaced is not None and replaced.token_id == 42
    assert replaced.logprob == pytest.approx(float(torch.log_softmax(logits[1], dim=-1)[42]), abs=1e-6)
    assert replaced.top == scores.rows[1].top
    assert scores.get(0, 5) is None


def test_token_pieces_are_exact_bytes_and_text_with_a_replacement_for_a_split_character(models_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(models_dir / "smollm2" / "current" / "tokenizer.json"))
    pieces = TokenPieces(tokenizer)
    text = "é 🌍 ok? <|im_end|>"
    ids = tokenizer.encode(text).ids
    assert b"".join(pieces.piece(i)[1] for i in ids).decode() == text
    split = [pieces.piece(i) for i in ids if pieces.piece(i)[1] and not _complete(pieces.piece(i)[1])]
    assert split and all("\ufffd" in t for t, _ in split)  # the emoji's pieces
    assert pieces.piece(tokenizer.token_to_id("<|im_end|>")) == ("<|im_end|>", b"<|im_end|>")


def _complete(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


# ----------------------------------------------------------------- the engine on the tiny model


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu", "float32")


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    # Requests arriving together share a batch (a generous wait for them on a busy machine).
    eng = Engine(loaded, EngineConfig(max_batch_size=4, max_prompt_tokens=128, max_new_tokens=64, batch_wait_s=0.3))
    eng.start()
    yield eng
    eng.close()


async def collect(engine: Engine, ids: list[int], params: SamplingParams) -> list[GenerationEvent]:
    return [event async for event in engine.submit(ids, params)]


async def test_top_logprobs_out_of_range_or_without_logprobs_is_invalid_naming_the_field(engine: Engine) -> None:
    for params in (SamplingParams(logprobs=True, top_logprobs=21), SamplingParams(top_logprobs=3)):
        with pytest.raises(InvalidArgument) as info:
            engine.submit(engine.encode("Hi"), params)
        assert [field for field, _ in info.value.violations] == ["sampling.top_logprobs"]


async def test_the_engines_logprobs_are_the_models_log_softmax_and_other_rows_are_unaffected(
    engine: Engine, loaded: LoadedModel
) -> None:
    prompt = engine.encode("The quick brown fox")
    other = engine.encode("Tell me about the sea")
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [i for e in await collect(engine, other, greedy) for i in e.token_ids]
    asked = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=4)
    # Both in one batch: the row that does not ask gets the same tokens and no logprobs.
    with_scores, without = await asyncio.gather(collect(engine, prompt, asked), collect(engine, other, greedy))
    assert with_scores[-1].batch_id == without[-1].batch_id
    assert [i for e in without for i in e.token_ids] == alone
    assert all(not e.logprobs for e in without)

    ids = [i for e in with_scores for i in e.token_ids]
    entries = [entry for e in with_scores for entry in e.logprobs]
    assert all(len(e.logprobs) == len(e.token_ids) for e in with_scores)
    assert [entry.token_id for entry in entries] == ids and len(ids) == 12
    # The reference: the Hugging Face model's own logits over prompt + answer, in float32.
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    reference = torch.log_softmax(logits, dim=-1)
    for position, entry in enumerate(entries):
        assert entry.token_id == int(reference[position].argmax())  # greedy: the likeliest
        assert entry.logprob == pytest.approx(float(reference[position, entry.token_id]), abs=1e-4)
        assert len(entry.top) == 4
        assert [t.token_id for t in entry.top] == reference[position].topk(4).indices.tolist()
        values = [t.logprob for t in entry.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(reference[position].topk(4).values.tolist(), abs=1e-4)
        assert entry.top[0].token_id == entry.token_id
        assert all(t.bytes.decode("utf-8", "replace") == t.token for t in entry.top)
    # The tokens' bytes spell the answer.
    text = "".join(e.text for e in with_scores)
    assert b"".join(entry.bytes for entry in entries) == loaded.tokenizer.decode(ids).encode()
    assert text == loaded.tokenizer.decode(ids)


async def test_sampled_rows_get_the_tempered_distribution_and_a_stop_token_has_its_entry(
    engine: Engine, loaded: LoadedModel
) -> None:
    prompt = engine.encode("Once upon a time")
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=5, ignore_eos=True, logprobs=True)
    events = await collect(engine, prompt, params)
    ids = [i for e in events for i in e.token_ids]
    entries = [entry for e in events for entry in e.logprobs]
    assert [e.token_id for e in entries] == ids and all(e.top == () for e in entries)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    reference = torch.log_softmax(logits / 0.7, dim=-1)
    got = [e.logprob for e in entries]
    assert got == pytest.approx([float(reference[p, t]) for p, t in enumerate(ids)], abs=1e-4)
    # A stop token ends the answer; it is in token_ids, so it has its entry too.
    stop = ids[3]
    stopped = await collect(engine, prompt, SamplingParams(**{**params.__dict__, "stop_token_ids": (stop,)}))
    last = stopped[-1]
    assert last.finish_reason == "stop" and last.token_ids == [stop]
    assert [e.token_id for e in last.logprobs] == [stop]


async def test_a_prompt_prefilled_in_chunks_inside_decode_steps_gets_its_logprobs_too(loaded: LoadedModel) -> None:
    # The long prompt's first token comes from the last chunk of a mixed step; the decoding row
    # beside it asks for log probabilities as well (the mixed step's decode rows).
    eng = Engine(loaded, EngineConfig(max_batch_size=4, max_prompt_tokens=512, max_new_tokens=64, prefix_caching=False))
    eng.start()
    long_prompt = eng.encode("Tell me about the sea, the sky and everything in between. " * 12)
    short_prompt = eng.encode("Hello there")
    forwards: list[str] = []
    real = eng.runner.mixed

    def counted(*args: object) -> object:
        forwards.append("mixed")
        return real(*args)  # type: ignore[arg-type]

    eng.runner.mixed = counted  # type: ignore[method-assign]

    def small_chunks(kind: str, batch: int) -> None:
        eng.core.speeds.prefill_tok_s, eng.core.speeds.step_s = 4000.0, 0.01  # chunks of 128 tokens

    asked = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=2)
    try:
        eng.fault_hook = small_chunks
        short = eng.submit(short_prompt, SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=True))
        first = await short.__anext__()
        long_events = await collect(eng, long_prompt, asked)
        short_events = [first, *[e async for e in short]]
    finally:
        eng.close()
    assert forwards, "the long prompt was prefilled inside decode steps"
    for prompt, events in ((long_prompt, long_events), (short_prompt, short_events)):
        ids = [i for e in events for i in e.token_ids]
        entries = [entry for e in events for entry in e.logprobs]
        assert [entry.token_id for entry in entries] == ids
        with torch.inference_mode():
            logits = loaded.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        reference = torch.log_softmax(logits, dim=-1)
        got = [entry.logprob for entry in entries]
        assert got == pytest.approx([float(reference[p, t]) for p, t in enumerate(ids)], abs=1e-4)
    assert all(len(entry.top) == 2 for e in long_events for entry in e.logprobs)
