"""Retry advice spread by refusal pressure (`RetryPacing`).

A refusal's own advice is the time until room opens for *one* request: the queue's excess
over the target, or until old entries leave the window. Under sustained overload every refused
caller gets about the same advice, and they all come back together for the one opening: a herd
that is refused again, costs the gateway a refusal each, and, with the window, repeats itself
every window length (everyone admitted together leaves together). So where the gateway has
lately refused many callers for each request it admitted, it spreads their retries: the advice
is stretched by a random factor between 1 and 1 + refusals per admission (over about the last
second, per model), never past the longest advice (a window). Callers then come back about as
fast as requests are admitted, spread out instead of in a herd; with few refusals per admission
(ordinary bursts) the advice is what it was.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable

from llmesh.errors import ResourceExhausted

#: How long refusals and admissions are remembered (the decay time constant, seconds).
PRESSURE_HALF_LIFE_S = 0.7
#: Below this many refusals per admission the advice is left as it is.
SPREAD_FROM = 1.0

_RETRY_IN = re.compile(r"retry in [0-9.]+s")


class _Rates:
    """Refusals and admissions, each an exponentially decaying count."""

    __slots__ = ("admitted", "at", "refused")

    def __init__(self, now: float) -> None:
        self.refused = 0.0
        self.admitted = 0.0
        self.at = now

    def decay(self, now: float) -> None:
        if now > self.at:
            keep = math.exp2(-(now - self.at) / PRESSURE_HALF_LIFE_S)
            self.refused *= keep
            self.admitted *= keep
            self.at = now


class RetryPacing:
    """Per model: how many callers were refused per request admitted lately, and the spread
    advice that follows from it."""

    def __init__(
        self,
        longest: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self.longest = longest
        self.clock = clock
        self.uniform = uniform
        self._rates: dict[str, _Rates] = {}

    def _of(self, model: str) -> _Rates:
        now = self.clock()
        rates = self._rates.get(model)
        if rates is None:
            rates = self._rates[model] = _Rates(now)
        rates.decay(now)
        return rates

    def admitted(self, model: str) -> None:
        self._of(model).admitted += 1.0

    def pressure(self, model: str) -> float:
        """Refusals per admission lately (refusals alone when nothing was admitted)."""
        rates = self._of(model)
        return rates.refused / max(rates.admitted, 1.0)

    def refused(self, model: str, refusal: ResourceExhausted) -> ResourceExhausted:
        """Counts the refusal and returns it with its advice spread (the same one when the
        pressure is low or the advice already the longest)."""
        pressure = self.pressure(model)
        self._of(model).refused += 1.0
        if pressure < SPREAD_FROM or refusal.retry_after >= self.longest:
            return refusal
        spread = min(self.longest, refusal.retry_after * (1.0 + pressure * self.uniform()))
        if spread <= refusal.retry_after:
            return refusal
        return deferred(refusal, round(spread, 3))


def deferred(refusal: ResourceExhausted, retry_after: float) -> ResourceExhausted:
    """The same refusal advising `retry_after` (its message says so too)."""
    message = _RETRY_IN.sub(f"retry in {retry_after:.3f}s", refusal.message)
    again = ResourceExhausted(message, retry_after=retry_after, reason=refusal.reason, metadata=dict(refusal.metadata))
    again.extra_trailing = list(refusal.extra_trailing)
    return again


__all__ = ["PRESSURE_HALF_LIFE_S", "SPREAD_FROM", "RetryPacing", "deferred"]
