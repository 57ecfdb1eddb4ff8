"""The semantic-cache evaluation: the labelled pairs and the threshold choice."""

from __future__ import annotations

import numpy as np

from bench.cache_eval import PAIRS, Pair, evaluate, load_pairs, pick_threshold


def test_pairs_are_many_balanced_and_hard() -> None:
    pairs = load_pairs(PAIRS)
    assert len(pairs) >= 200
    same = sum(p.same for p in pairs)
    assert 0.4 <= same / len(pairs) <= 0.6
    kinds = {p.kind for p in pairs if not p.same}
    assert {"negation", "number", "entity", "antonym"} <= kinds
    assert len({(p.a, p.b) for p in pairs}) == len(pairs)


def test_threshold_is_the_highest_recall_at_the_precision_floor() -> None:
    pairs = [Pair("a", "b", True), Pair("c", "d", True), Pair("e", "f", False), Pair("g", "h", True)]
    sims = np.array([0.95, 0.80, 0.85, 0.75])
    curve = evaluate(pairs, sims, [0.70, 0.80, 0.90], reasons=[None] * 4)
    assert [(r["threshold"], r["precision"], r["recall"]) for r in curve] == [
        (0.7, 0.75, 1.0),
        (0.8, 0.6667, 0.6667),
        (0.9, 1.0, 0.3333),
    ]
    assert pick_threshold(curve, 0.97)["threshold"] == 0.9
    assert pick_threshold(curve, 0.7)["threshold"] == 0.7
    guarded = evaluate(pairs, sims, [0.70], reasons=[None, None, "negation", None])
    assert guarded[0]["precision"] == 1.0 and guarded[0]["precision_no_guard"] == 0.75
