"""A retry budget: retries as a share of requests, so that during an outage they cannot multiply
the load on what is left. The gateway's replica router and the openai backend's
replicas each keep one.

Every first attempt earns `ratio` of a token, up to `burst`; a retry spends a whole one, or is
refused when less than one is left. With ratio 0.1, retries add at most 10% to the requests sent
once the burst is spent, whatever fails; the burst lets the odd failure be retried at once.
"""

from __future__ import annotations


class RetryBudget:
    """Retries as a share of requests: each request earns `ratio` of a token (up to `burst`),
    each retry spends one."""

    def __init__(self, ratio: float, burst: float) -> None:
        self.ratio = ratio
        self.burst = burst
        self.tokens = burst
        self.retries = 0
        self.refused = 0

    def earn(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def spend(self) -> bool:
        if self.tokens >= 1 - 1e-9:
            self.tokens -= 1
            self.retries += 1
            return True
        self.refused += 1
        return False
