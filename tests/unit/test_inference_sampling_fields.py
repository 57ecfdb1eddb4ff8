"""Penalties, biases, top_k / min_p and stop token ids of the builtin engine, row by row: each
changes its own row's choice and never a neighbour's."""

from __future__ import annotations

import torch

from services.inference.engine.sampling import Adjustments, RowAdjustment, adjust, choose


def test_logit_bias_and_penalties_touch_only_their_row() -> None:
    logits = torch.randn((3, 50), generator=torch.Generator().manual_seed(0))
    free = choose(logits.clone(), [], [], [], [], [])
    biased = Adjustments((RowAdjustment(row=1, bias=((7, 100.0),)),))
    chosen = choose(logits.clone(), [], [], [], [], [], None, biased)
    assert chosen[1] == 7 and chosen[0] == free[0] and chosen[2] == free[2]


def test_repetition_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = adjust(logits.clone(), Adjustments((RowAdjustment(row=0, repetition=2.0, seen=(0, 1, 1)),)))
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5]
    out = adjust(logits.clone(), Adjustments((RowAdjustment(row=0, presence=0.5, frequency=1.0, generated=(2, 2, 3)),)))
    assert out[0].tolist() == [2.0, -2.0, 1.0 - 2.0 - 0.5, 0.5 - 1.0 - 0.5]


def test_top_k_one_is_greedy_and_min_p_keeps_only_the_likely() -> None:
    logits = torch.randn((4, 100), generator=torch.Generator().manual_seed(1))
    greedy = torch.argmax(logits, dim=-1)
    rows = [0, 1, 2, 3]
    filters = Adjustments(filters={r: (1, 0.0) for r in rows})
    for seed in range(5):
        sampled = choose(logits.clone(), rows, [1.0] * 4, [1.0] * 4, [seed] * 4, [0] * 4, None, filters)
        assert sampled.tolist() == greedy.tolist()
    only_top = Adjustments(filters={r: (0, 0.999) for r in rows})
    assert choose(logits.clone(), rows, [1.5] * 4, [1.0] * 4, [3] * 4, [0] * 4, None, only_top).tolist() == (
        greedy.tolist()
    )
