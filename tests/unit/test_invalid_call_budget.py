"""A key's budget of invalid calls, on a fake clock."""

from __future__ import annotations

import pytest

from llmesh.errors import ResourceExhausted
from services.gateway.intake import InvalidCallBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_past_its_budget_a_key_waits_until_its_oldest_refusal_is_a_minute_old() -> None:
    clock = Clock()
    budget = InvalidCallBudget(3, clock)
    for _ in range(3):
        budget.check("k1")
        budget.record("k1")
        clock.now += 10
    with pytest.raises(ResourceExhausted) as refused:
        budget.check("k1")
    assert refused.value.retry_after == pytest.approx(30.0)  # first refusal at 1000, now 1030
    assert refused.value.reason == "INVALID_REQUESTS_LIMIT"
    budget.check("k2")  # another key is judged on its own
    clock.now = 1060.0
    budget.check("k1")  # the first refusal left the window
    budget.record("k1")
    with pytest.raises(ResourceExhausted):
        budget.check("k1")


def test_the_anonymous_caller_and_a_budget_of_zero_are_never_limited() -> None:
    clock = Clock()
    budget = InvalidCallBudget(1, clock)
    for _ in range(5):
        budget.record("")
        budget.check("")
    off = InvalidCallBudget(0, clock)
    for _ in range(5):
        off.record("k1")
        off.check("k1")
