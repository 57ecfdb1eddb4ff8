"""Retry advice under refusal pressure (services/gateway/admission/pacing.py): callers refused
many times per admission are told to come back spread out, not all at the one opening."""

from __future__ import annotations

import asyncio

import pytest

from llmesh.errors import ResourceExhausted
from services.gateway.admission.pacing import PRESSURE_HALF_LIFE_S, RetryPacing


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refusal(retry_after: float = 0.05) -> ResourceExhausted:
    return ResourceExhausted(
        f"no replica can start the request within 3s; retry in {retry_after:.3f}s",
        retry_after=retry_after,
        reason="QUEUE_WAIT_TOO_LONG",
        metadata={"target_s": "3"},
    )


def test_advice_is_left_alone_while_callers_are_admitted_about_as_often_as_refused() -> None:
    clock = FakeClock()
    pacing = RetryPacing(5.0, clock=clock, uniform=lambda: 1.0)
    for _ in range(5):
        pacing.admitted("m")
        original = refusal()
        assert pacing.refused("m", original) is original
    assert pacing.pressure("m") == pytest.approx(1.0)


def test_many_refusals_per_admission_spread_the_advice_and_the_message_says_so() -> None:
    clock = FakeClock()
    draw = [1.0]
    pacing = RetryPacing(5.0, clock=clock, uniform=lambda: draw[0])
    pacing.admitted("m")
    for _ in range(10):
        pacing.refused("m", refusal())
    assert pacing.pressure("m") == pytest.approx(10.0)
    widest = pacing.refused("m", refusal(0.05))
    assert widest.retry_after == pytest.approx(0.05 * 11)
    assert "retry in 0.550s" in widest.message
    assert widest.reason == "QUEUE_WAIT_TOO_LONG" and widest.metadata == {"target_s": "3"}
    # The drawn factor can be 1: the advice stays what it was.
    draw[0] = 0.0
    assert pacing.refused("m", refusal(0.05)).retry_after == pytest.approx(0.05)
    draw[0] = 0.5
    assert pacing.refused("m", refusal(0.05)).retry_after == pytest.approx(0.05 * (1 + 12 * 0.5))


def test_spread_advice_never_passes_the_longest() -> None:
    clock = FakeClock()
    pacing = RetryPacing(5.0, clock=clock, uniform=lambda: 1.0)
    for _ in range(50):
        pacing.refused("m", refusal())
    assert pacing.refused("m", refusal(2.0)).retry_after == 5.0
    at_longest = refusal(5.0)
    assert pacing.refused("m", at_longest) is at_longest


def test_pressure_fades_once_refusals_stop_and_is_kept_per_model() -> None:
    clock = FakeClock()
    pacing = RetryPacing(5.0, clock=clock, uniform=lambda: 1.0)
    for _ in range(40):
        pacing.refused("busy", refusal())
    assert pacing.pressure("busy") == pytest.approx(40.0)
    assert pacing.pressure("idle") == 0.0
    clock.now += 10 * PRESSURE_HALF_LIFE_S
    assert pacing.pressure("busy") < 0.05
    original = refusal()
    assert pacing.refused("busy", original) is original


def test_a_full_window_sends_a_herd_of_callers_back_spread_over_the_window() -> None:
    # The budget fits two requests a window (5 s); both were admitted at t=0. At t=4.5 every
    # refusal's own advice is 0.5 s (when they leave): sixty callers told that one moment come
    # back together for one opening. Paced, they spread over up to the window.
    from services.gateway.admission.config import AdmissionConfig
    from services.gateway.admission.controller import AdmissionController, Ask
    from services.gateway.admission.window import WeightWindow

    clock = FakeClock()
    window = WeightWindow(AdmissionConfig(budget=200, window_seconds=5.0, tenant_share=1.0), clock=clock)
    controller = AdmissionController(window, clock=clock)
    ask = Ask("t", "interactive", "m", "m", 10)
    for _ in range(2):
        hold, refusal = controller.reserve(ask, 10, 30.0)
        assert refusal is None
        admission = asyncio.run(controller.admit(ask, 10, hold, 30.0))
        assert admission.weight == 100 and admission.ticket is not None
        admission.ticket.progress(10)  # generated in full: no longer in flight, still in the window
        admission.ticket.finish()
    clock.now += 4.5
    advice = []
    for _ in range(60):
        hold, refusal = controller.reserve(ask, 10, 30.0)
        assert hold is None and refusal is not None
        advice.append(controller.shed(ask, refusal).retry_after)
    assert advice[0] == pytest.approx(0.5)
    assert all(0.5 - 1e-9 <= a <= 5.0 for a in advice)
    late = sorted(advice[20:])
    assert late[len(late) // 2] > 1.5  # half of them at least three times later than the one moment
    assert late[-1] > 3.0
