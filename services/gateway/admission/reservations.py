"""Reservations: what a request holds on its way to admission (`Hold`, its predicted weight
before its hops) and once admitted (`Ticket`, its whole weight, refunded as it ends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class ReservationBook(Protocol):
    """What a hold and a ticket tell the window that made them (`WeightWindow`): a hold released,
    a ticket's tokens coming back, a ticket finished with the weight it did not use."""

    def release_hold(self, hold: Hold) -> None: ...

    def ticket_progressed(self, ticket: Ticket, weight: int) -> None: ...

    def ticket_finished(self, ticket: Ticket, refund: int) -> None: ...


class Hold:
    """The predicted weight of a request that passed `precheck` and is on its way to `plan`
    (retrieval, tokenizer). Later prechecks and plans count it, so a burst that arrives together
    is shed at once instead of each request paying for its hops before finding the window full."""

    __slots__ = ("_window", "model", "on_release", "released", "tenant", "weight")

    def __init__(self, window: ReservationBook, tenant: str, weight: int, model: str = "") -> None:
        self._window = window
        self.tenant = tenant
        self.weight = weight
        self.model = model
        self.released = False
        # Called once when released (the load book stops counting it as on its way).
        self.on_release: Callable[[], None] | None = None

    def release(self) -> None:
        """Idempotent; called before the exact admission and when the request ends."""
        if not self.released:
            self.released = True
            self._window.release_hold(self)
            if self.on_release is not None:
                self.on_release()


class Ticket:
    """An admitted request's reservation. `progress` as tokens come back; `finish` once on every
    exit path: the weight not generated leaves the flight and is refunded from the window."""

    __slots__ = (
        "_window",
        "admitted_at",
        "entry",
        "finished",
        "first_at",
        "first_tokens",
        "last_at",
        "model",
        "on_finish",
        "on_refund",
        "reserved",
        "streaming",
        "tenant",
        "unit",
        "used",
    )

    def __init__(
        self,
        window: ReservationBook,
        tenant: str,
        model: str,
        unit: int,
        reserved: int,
        entry: list[float],
        admitted_at: float,
    ) -> None:
        self._window = window
        self.admitted_at = admitted_at
        self.last_at = admitted_at  # when its latest tokens came back
        self.entry = entry
        self.tenant = tenant
        self.model = model
        self.unit = unit
        self.reserved = reserved
        self.used = 0
        self.finished = False
        self.streaming = False
        # When its first tokens came back, and how many: the pace after them is the engine's
        # time per token at its batch (the load book learns it).
        self.first_at: float | None = None
        self.first_tokens = 0
        # Called with the refunded weight (a cluster window refunds it in Redis too).
        self.on_refund: Callable[[int], None] | None = None
        # Called once with the ticket when it finishes (the load book counts the answer's length).
        self.on_finish: Callable[[Ticket], None] | None = None

    def progress(self, tokens: int) -> None:
        """`tokens` more were generated."""
        if self.finished or tokens <= 0:
            return
        step = min(self.unit * tokens, self.reserved - self.used)
        self.used += step
        self._window.ticket_progressed(self, step)

    def finish(self) -> int:
        """Idempotent; returns the weight refunded."""
        if self.finished:
            return 0
        self.finished = True
        refund = self.reserved - self.used
        self._window.ticket_finished(self, refund)
        if refund and self.on_refund is not None:
            self.on_refund(refund)
        if self.on_finish is not None:
            self.on_finish(self)
        return refund

    def seconds_per_token(self) -> float | None:
        """Its pace after the first tokens (None: too few tokens to tell)."""
        tokens = self.output_tokens - self.first_tokens
        if self.first_at is None or tokens < 2:
            return None
        return max(0.0, self.last_at - self.first_at) / tokens

    @property
    def output_tokens(self) -> int:
        """Tokens generated so far (the weight used over the weight per token)."""
        return self.used // max(1, self.unit)
