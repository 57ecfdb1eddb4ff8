"""The grammar rows of a batch as the engine decodes them (engine/grammar.py, engine/sampling.py):
the masks filled in one batch call equal each row's own, the lazy choice (a greedy row whose
likeliest token is allowed is not masked) picks the very tokens of the full masks, a whole batch
of schemas decoded that way from random logits still answers valid JSON every time, and text
written to the budget's end costs no closing-path walks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from bench.schemas import SCHEMAS
from llmesh.errors import InvalidArgument
from services.inference.engine.decoding import ResponseFormatSpec
from services.inference.engine.grammar import Grammars, RowGrammar
from services.inference.engine.sampling import (
    Adjustments,
    GrammarRows,
    RowAdjustment,
    adjust,
    allowed_tokens,
    choose,
)

EOS = frozenset({2})
NOTE = {"type": "object", "properties": {"title": {"type": "string"}, "n": {"type": "integer"}}, "required": ["title"]}


@pytest.fixture(scope="module")
def grammars(tiny_model: Path) -> Grammars:
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    return Grammars(tokenizer, tokenizer.get_vocab_size(with_added_tokens=True), EOS)


def spec(schema: object) -> ResponseFormatSpec:
    return ResponseFormatSpec(kind="json_schema", schema=json.dumps(schema))


def rows_in_states(grammars: Grammars, rng: random.Random) -> list[RowGrammar]:
    """Rows of one schema, each a different number of random allowed tokens in; the last on its
    closing path (a budget of its closing distance)."""
    rows = []
    for steps in (0, 1, 3, 6, 10):
        row = grammars.row(spec(NOTE), 64)
        for _ in range(steps):
            row.take(rng.choice(allowed(grammars, row)), 40)
        rows.append(row)
    closing = grammars.row(spec(NOTE), 64)
    while not closing.closing:
        closing.take(rng.choice(allowed(grammars, closing)), 4)
    rows.append(closing)
    return rows


def allowed(grammars: Grammars, row: RowGrammar) -> list[int]:
    bitmask = torch.zeros((1, grammars.words), dtype=torch.int32)
    row.fill_mask(bitmask, 0)
    return allowed_tokens(bitmask, grammars.vocab_size)[0].nonzero().flatten().tolist()


def test_the_batch_fill_gives_each_rows_own_mask(grammars: Grammars) -> None:
    rows = rows_in_states(grammars, random.Random(3))
    batch = torch.zeros((len(rows), grammars.words), dtype=torch.int32)
    grammars.fill_masks(rows, batch)
    for i, row in enumerate(rows):
        own = torch.zeros((1, grammars.words), dtype=torch.int32)
        row.fill_mask(own, 0)
        assert torch.equal(batch[i], own[0]), i
    assert int(allowed_tokens(batch[-1:], grammars.vocab_size).sum()) == 1  # the closing row: its path's token


def test_the_lazy_choice_picks_the_tokens_of_the_full_masks(grammars: Grammars) -> None:
    rng = random.Random(5)
    rows = rows_in_states(grammars, rng)
    vocab = grammars.vocab_size
    batch_rows = [0, 1, 2, 4, 5, 6]  # batch row 3 is free, rows 1 and 5 sample
    sampled = [1, 3, 5]
    masked_away = kept = 0
    for trial in range(12):
        logits = torch.randn((7, vocab), generator=torch.Generator().manual_seed(trial))
        for i, row in zip(batch_rows, rows, strict=True):  # half the rows: an allowed token likeliest
            if rng.random() < 0.5:
                logits[i, rng.choice(allowed(grammars, row))] += 50.0
        full = torch.zeros((len(rows), grammars.words), dtype=torch.int32)
        grammars.fill_masks(rows, full)
        free = torch.argmax(logits, dim=-1).tolist()
        ok = allowed_tokens(full, vocab)
        for k, i in enumerate(batch_rows):
            if i not in sampled:
                masked_away += not bool(ok[k, free[i]])
                kept += bool(ok[k, free[i]])
        params = (sampled, [0.8] * 3, [0.9] * 3, [7, 8, 9], [trial] * 3)
        lazy = choose(logits.clone(), *params, GrammarRows(batch_rows, rows, grammars.words, grammars.fill_masks))
        eager = choose(logits.clone(), *params, (batch_rows, full))
        assert lazy.tolist() == eager.tolist(), trial
    assert masked_away and kept  # both ways of a greedy row were taken


def test_a_batch_of_schemas_decoded_lazily_answers_valid_json(grammars: Grammars) -> None:
    rng = random.Random(11)
    budget = 48
    rows: list[tuple[dict, RowGrammar]] = []
    for _, schema in SCHEMAS:
        try:
            rows.append((schema, grammars.row(spec(schema), budget)))
        except InvalidArgument:
            continue
    tokens: list[list[int]] = [[] for _ in rows]
    live = list(range(len(rows)))
    while live:
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        logits = torch.randn((len(live), grammars.vocab_size), generator=gen)
        sampled = [i for i in range(len(live)) if i % 3 == 0]
        constraints = GrammarRows(
            list(range(len(live))), [rows[k][1] for k in live], grammars.words, grammars.fill_masks
        )
        n = len(sampled)
        chosen = choose(logits, sampled, [1.0] * n, [1.0] * n, list(range(n)), [0] * n, constraints).tolist()
        for i, k in enumerate(live):
            row = rows[k][1]
            tokens[k].append(row.take(chosen[i], budget - len(tokens[k]) - 1))
        live = [k for k in live if not rows[k][1].stopped and tokens[k][-1] not in EOS and len(tokens[k]) < budget]
    assert len(rows) >= len(SCHEMAS) - 2
    for (schema, _), answer in zip(rows, tokens, strict=True):
        text = grammars.tokenizer.decode_str([t for t in answer if t not in EOS])
        jsonschema.validate(json.loads(text), schema)


def test_each_rows_cached_bias_tensors_add_its_own_biases() -> None:
    logits = torch.randn((4, 50), generator=torch.Generator().manual_seed(2))
    rows = (
        RowAdjustment(row=0, bias=((3, -100.0), (7, 5.0))),
        RowAdjustment(row=2, bias=((3, 2.5),), repetition=1.3, seen=(3, 4)),
        RowAdjustment(row=3, presence=0.5, generated=(1, 1)),
    )
    out = adjust(logits.clone(), Adjustments(rows))
    assert torch.equal(adjust(logits.clone(), Adjustments(rows)), out)  # again, from the cached tensors
    expected = logits.clone()
    expected[0, 3] -= 100.0
    expected[0, 7] += 5.0
    for t in (3, 4):  # the repetition penalty, then the bias
        v = expected[2, t]
        expected[2, t] = v / 1.3 if v > 0 else v * 1.3
    expected[2, 3] += 2.5
    expected[3, 1] -= 0.5
    assert torch.allclose(out, expected)


def test_text_to_the_budget_replays_the_closing_path_instead_of_walking_it(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free string written to the budget's end: after text the last closing path is checked
    again by consuming it (no masks), and the row closes along it by its last token."""
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "note": {"type": "string"}}}
    schema["required"] = ["title", "note"]
    budget = 64
    row = grammars.row(spec(schema), budget)
    walked = 0
    path_token = RowGrammar.path_token

    def counted(self: RowGrammar, matcher: object, state: tuple[bool, bool]) -> int | None:
        nonlocal walked
        walked += 1
        return path_token(self, matcher, state)  # type: ignore[arg-type]

    monkeypatch.setattr(RowGrammar, "path_token", counted)
    text = grammars.tokenizer.tokenize_str('{"title":"' + " the sea is wide and grey" * 30)
    tokens: list[int] = []
    while len(tokens) < budget and not row.stopped:
        wanted = text[len(tokens)] if not row.closing else allowed(grammars, row)[0]
        tokens.append(row.take(wanted, budget - len(tokens) - 1))
    answer = json.loads(grammars.tokenizer.decode_str([t for t in tokens if t not in EOS]))
    assert len(tokens) == budget and set(answer) == {"title", "note"} and len(answer["title"]) > 100
    # Walks of the ~7-token path: at the start's structural tokens (`{"title":"`, about 30 masks),
    # none after text (one per token near the end before: about 120).
    assert walked < 50, walked
