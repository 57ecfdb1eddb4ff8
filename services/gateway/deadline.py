"""A gateway request's deadline, which every downstream call takes what is left of."""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmesh.errors import DeadlineExceeded


@dataclass
class Deadline:
    """Absolute deadline of one gateway request; every downstream call gets what is left."""

    expires_at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.expires_at - time.monotonic())

    def check(self, what: str) -> float:
        """The time left, or DeadlineExceeded at once when it is spent: no call starts after that."""
        left = self.remaining()
        if left <= 0:
            raise CallerDeadline(f"{what}: the request's deadline is spent")
        return left


class CallerDeadline(DeadlineExceeded):
    """The caller's own deadline ran out (not the hop's budget): no verdict on the downstream."""
