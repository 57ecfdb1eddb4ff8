"""Constrained decoding (services/inference/engine/grammar.py) on SmolLM2's real tokenizer, driven
by random logits (the worst a model can do): every answer parses and validates, however small the
budget, and a budget that cannot hold the shortest answer is refused up front."""

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
from services.inference.engine.sampling import allowed_tokens, choose

EOS = frozenset({2})


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer, tokenizer.get_vocab_size(with_added_tokens=True), EOS)


def schema_spec(schema: object) -> ResponseFormatSpec:
    return ResponseFormatSpec(kind="json_schema", schema=json.dumps(schema))


def run(grammars: Grammars, row: RowGrammar, budget: int, rng: random.Random) -> tuple[list[int], str]:
    """Decodes one row under its grammar from random logits, as the engine does."""
    tokens: list[int] = []
    while len(tokens) < budget:
        bitmask = torch.zeros((1, grammars.words), dtype=torch.int32)
        row.fill_mask(bitmask, 0)
        logits = torch.randn((1, grammars.vocab_size), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        chosen = int(choose(logits, [], [], [], [], [], ([0], bitmask))[0])
        token = row.take(chosen, budget - len(tokens) - 1)
        tokens.append(token)
        if token in EOS or row.stopped:
            break
    return tokens, grammars.tokenizer.decode_str([t for t in tokens if t not in EOS])


@pytest.mark.parametrize("budget", [48, 96])
def test_every_answer_parses_and_validates_whatever_the_budget(grammars: Grammars, budget: int) -> None:
    rng = random.Random(budget)
    refused = 0
    for _, schema in SCHEMAS:
        try:
            row = grammars.row(schema_spec(schema), budget)
        except InvalidArgument as exc:
            assert exc.violations[0][0] == "sampling.max_new_tokens"
            refused += 1
            continue
        tokens, text = run(grammars, row, budget, rng)
        assert len(tokens) <= budget
        jsonschema.validate(json.loads(text), schema)
    assert refused <= 2  # only the largest shortest answers exceed a 48-token budget


def test_json_object_regex_and_choice(grammars: Grammars) -> None:
    rng = random.Random(1)
    _, text = run(grammars, grammars.row(ResponseFormatSpec(kind="json_object"), 24), 24, rng)
    assert isinstance(json.loads(text), dict)
    _, text = run(grammars, grammars.row(ResponseFormatSpec(kind="regex", regex="[0-9]{3}-[a-z]+"), 12), 12, rng)
    assert text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    choice = ResponseFormatSpec(kind="choice", choices=("yes", "no", "maybe so"))
    _, text = run(grammars, grammars.row(choice, 8), 8, rng)
    assert text in ("yes", "no", "maybe so")


def test_a_budget_below_the_shortest_answer_is_refused_up_front(grammars: Grammars) -> None:
    schema = {
        "type": "object",
        "properties": {f"field_{i}": {"type": "string"} for i in range(10)},
        "required": [f"field_{i}" for i in range(10)],
    }
    with pytest.raises(InvalidArgument) as info:
        grammars.row(schema_spec(schema), 8)
    assert info.value.violations[0][0] == "sampling.max_new_tokens"
    grammars.row(schema_spec(schema), 200)


def test_a_schema_the_library_cannot_compile_is_refused_naming_the_field(grammars: Grammars) -> None:
    with pytest.raises(InvalidArgument) as info:
        grammars.row(schema_spec({"type": "string", "pattern": "(unclosed"}), 32)
    assert info.value.violations[0][0] == "response_format.json_schema"
    with pytest.raises(InvalidArgument) as info:
        grammars.row(ResponseFormatSpec(kind="regex", regex="(a"), 32)
    assert info.value.violations[0][0] == "response_format.regex"


def test_a_schema_is_compiled_once_and_reused(grammars: Grammars) -> None:
    spec = schema_spec({"type": "object", "properties": {"only_here": {"type": "integer"}}})
    before = grammars.stats.compiled
    grammars.row(spec, 32)
    hits = grammars.stats.cache_hits
    grammars.row(spec, 32)
    assert grammars.stats.compiled == before + 1 and grammars.stats.cache_hits == hits + 1


def test_masks_touch_only_their_own_rows() -> None:
    logits = torch.randn((3, 70))
    bitmask = torch.zeros((1, 3), dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # only token 35
    chosen = choose(logits.clone(), [], [], [], [], [], ([1], bitmask))
    free = choose(logits.clone(), [], [], [], [], [])
    assert chosen[1] == 35 and chosen[0] == free[0] and chosen[2] == free[2]
    assert allowed_tokens(bitmask, 70)[0].nonzero().flatten().tolist() == [35]
