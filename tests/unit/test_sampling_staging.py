"""Sampling costs one host-to-device copy per decode step, not five: the
batch's fixed parameters are staged once per batch change; and the nucleus is found among the
likeliest tokens instead of a sort of the whole vocabulary, with the same tokens kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.inference.engine import sampling
from services.inference.engine.sampling import StagedParams, choose, nucleus_keep

VOCAB = 49152  # SmolLM2's


def full_sort_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus by a sort of the whole vocabulary (what the engine did before)."""
    nucleus = top_p < 1.0
    ranked, order = probs.sort(dim=-1, descending=True)
    before = ranked.cumsum(dim=-1) - ranked
    keep_sorted = (before < top_p[:, None]) | ~nucleus[:, None]
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, keep_sorted)


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat (the full-sort path) to peaked
def test_the_nucleus_keeps_the_tokens_a_full_sort_keeps(spread: float) -> None:
    generator = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(8, VOCAB, generator=generator) * spread
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 1.0, 0.7, 0.3])
    assert torch.equal(nucleus_keep(probs, top_p), full_sort_keep(probs, top_p))


def test_a_decode_loop_stages_its_parameters_once_per_batch_change(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    real = torch.tensor

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        made.append(args[0])
        return real(*args, **kwargs)

    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    stage = StagedParams()
    rows, temperature, top_p, seeds = [0, 2, 3], [0.7, 1.0, 0.9], [0.9, 1.0, 0.8], [11, -5, 2**62]
    first = choose(logits.clone(), rows, temperature, top_p, seeds, [0, 0, 0], stage=stage)
    monkeypatch.setattr(sampling.torch, "tensor", counting)
    second = choose(logits.clone(), rows, temperature, top_p, seeds, [1, 1, 1], stage=stage)
    assert made == [[1, 1, 1]] and stage.builds == 1  # the step's counters, nothing else
    monkeypatch.setattr(sampling.torch, "tensor", real)
    # The same tokens as parameters staged afresh for the call.
    assert torch.equal(second, choose(logits.clone(), rows, temperature, top_p, seeds, [1, 1, 1]))
    assert torch.equal(first, choose(logits.clone(), rows, temperature, top_p, seeds, [0, 0, 0]))
    choose(logits.clone(), rows[:2], temperature[:2], top_p[:2], seeds[:2], [2, 2], stage=stage)
    assert stage.builds == 2  # a row left the batch: staged again
