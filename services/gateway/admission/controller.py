"""The admission decision: the one object the request path calls (`AdmissionController`).

A request is refused only when no replica it may go to can start it within its time budget:
the predicted wait for a row (from the replicas' own load reports, `load.py`) against the
configured target (`LLMESH_ADMISSION_TARGET_SECONDS`) and, with its own prefill and decode at
the reported step time, against the caller's deadline. With a free row somewhere, nothing is
shed. The sliding window (an operator's budget over time, per tenant and lane) applies as
before. For a model whose backend reports nothing (no fresh report), the throughput-learned
in-flight limit and the deadline check at the measured throughput decide instead, as they did
before the engines reported their load.

Two calls per request: `reserve` before the expensive hops, on a predicted prompt length (it may
hold the predicted weight in the window until `admit`), and `admit` once the exact length is
known (it returns the Admission with its Ticket). A cacheable request asks `reserve` while it
waits for its cache lookup with `waiting_for_cache=True`: where load reports decide, it holds
nothing meanwhile (a hit costs the model nothing, and a busy cache must not crowd generation
out), and after a miss the request path asks `reserve` again before its expensive hops (the
engines may have filled during the lookup); on the fallback it holds its prediction as before,
so it is not refused after the wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from llmesh.errors import ResourceExhausted
from services.gateway.admission.capacity import CapacityLimit
from services.gateway.admission.config import (
    BATCH,
    REASON_DEADLINE,
    REASON_QUEUE_WAIT,
    Admission,
    AdmissionConfig,
    RequestTooHeavy,
)
from services.gateway.admission.load import LoadBook, Wait
from services.gateway.admission.pacing import RetryPacing
from services.gateway.admission.reservations import Hold, Ticket

#: Shortest retry advice (seconds).
MIN_RETRY_S = 0.05
#: How a deadline refusal's time was estimated without load reports.
THROUGHPUT = "at the measured throughput"


class Window(Protocol):
    """The sliding window, in process (`WeightWindow`, sync) or shared (`RedisWeightWindow`,
    whose `plan` is a coroutine)."""

    config: AdmissionConfig

    @property
    def lanes(self) -> tuple[str, ...]: ...

    def capacity(self, model: str = "") -> CapacityLimit: ...

    def precheck(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = ...,
        hold: bool = ...,
        model: str = ...,
        in_flight_limit: bool = ...,
    ) -> Hold | None: ...

    def plan(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = ...,
        allow_degrade: bool | None = ...,
        hold: Hold | None = ...,
        model: str = ...,
        in_flight_limit: bool = ...,
    ) -> Admission | Awaitable[Admission]: ...


@dataclass(frozen=True)
class Ask:
    """What admission needs to know of a request."""

    tenant: str
    lane: str
    #: The model key (the window's and the learned limit's key) and the route name (whose load).
    model: str
    route: str
    max_new_tokens: int


class AdmissionController:
    def __init__(
        self,
        window: Window,
        loads: LoadBook | None = None,
        *,
        target_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window = window
        self.loads = loads or LoadBook(clock)
        self.target_seconds = target_seconds if target_seconds is not None else window.config.target_seconds
        self.clock = clock
        # Refusals' advice spread by how many callers are refused per admission (`shed`).
        self.pacing = RetryPacing(window.config.window_seconds, clock=clock)

    @property
    def config(self) -> AdmissionConfig:
        return self.window.config

    @property
    def lanes(self) -> tuple[str, ...]:
        return self.window.lanes

    def capacity(self, model: str) -> CapacityLimit:
        return self.window.capacity(model)

    def predicted_wait(self, ask: Ask, input_tokens: int) -> Wait | None:
        """The soonest start the route's replicas offer (None: none reports its load)."""
        return self.loads.predict(ask.route, input_tokens, ask.max_new_tokens, batch=ask.lane == BATCH)

    # ------------------------------------------------------------------ the two calls

    def reserve(
        self, ask: Ask, predicted_tokens: int, deadline_left: float, *, waiting_for_cache: bool = False
    ) -> tuple[Hold | None, ResourceExhausted | None]:
        """(the hold, None) when the request may go on to its hops, else (None, the refusal)."""
        wait = self.predicted_wait(ask, predicted_tokens)
        if wait is not None:
            refusal = self._judge(wait, deadline_left)
            if refusal is not None:
                return None, refusal
            held, refusal = self._precheck(ask, predicted_tokens, hold=not waiting_for_cache, in_flight_limit=False)
            if held is not None:
                load = self.loads.model(ask.route)
                load.reserve()
                held.on_release = load.unreserve
            return held, refusal
        expected = self.capacity(ask.model).drain_seconds(predicted_tokens * ask.max_new_tokens)
        if expected > deadline_left:
            return None, self._too_slow(expected, deadline_left, THROUGHPUT)
        return self._precheck(ask, predicted_tokens, hold=True, in_flight_limit=True)

    async def admit(self, ask: Ask, input_tokens: int, hold: Hold | None, deadline_left: float) -> Admission:
        """Admits the request at its exact size (or raises ResourceExhausted / RequestTooHeavy).
        A request still holding its reservation was judged by `reserve` before its hops; it is
        not refused for the time they took."""
        admission = await self._admit(ask, input_tokens, hold, deadline_left)
        self.pacing.admitted(ask.route)
        return admission

    def shed(self, ask: Ask, refusal: ResourceExhausted) -> ResourceExhausted:
        """The refusal a caller gets: its advice spread by how many callers are refused per
        admission lately (`RetryPacing`). Called once per refusal that reaches a caller (not for
        one a cache hit made moot)."""
        return self.pacing.refused(ask.route, refusal)

    async def _admit(self, ask: Ask, input_tokens: int, hold: Hold | None, deadline_left: float) -> Admission:
        own_hold = hold.weight if hold is not None and not hold.released else 0
        wait = self.predicted_wait(ask, input_tokens)
        if wait is not None:
            if not own_hold:
                refusal = self._judge(wait, deadline_left)
                if refusal is not None:
                    if hold is not None:
                        hold.release()
                    raise refusal
            flight = False
        else:
            expected = self.capacity(ask.model).drain_seconds(input_tokens * ask.max_new_tokens - own_hold)
            if not own_hold and expected > deadline_left:
                if hold is not None:
                    hold.release()
                raise self._too_slow(expected, deadline_left, THROUGHPUT)
            flight = True
        decision = self.window.plan(
            ask.tenant,
            input_tokens,
            ask.max_new_tokens,
            ask.lane,
            hold=hold,
            model=ask.model,
            in_flight_limit=flight,
        )
        admission = await decision if asyncio.iscoroutine(decision) else decision
        assert isinstance(admission, Admission)
        self._dispatched(ask.route, admission.ticket)
        return admission

    # ------------------------------------------------------------------ internals

    def _precheck(
        self, ask: Ask, predicted_tokens: int, *, hold: bool, in_flight_limit: bool
    ) -> tuple[Hold | None, ResourceExhausted | None]:
        try:
            held = self.window.precheck(
                ask.tenant,
                predicted_tokens,
                ask.max_new_tokens,
                ask.lane,
                hold,
                model=ask.model,
                in_flight_limit=in_flight_limit,
            )
        except RequestTooHeavy:
            return None, None  # decided exactly by admit once the true token count is known
        except ResourceExhausted as exc:
            return None, exc
        return held, None

    def _judge(self, wait: Wait, deadline_left: float) -> ResourceExhausted | None:
        """A request that can start now is never refused; one that must queue is, when the
        queue is longer than the target or it could not finish before its deadline."""
        if wait.seconds <= 0:
            return None
        if wait.seconds > self.target_seconds:
            return ResourceExhausted(
                f"no replica can start the request within {self.target_seconds:g}s "
                f"(LLMESH_ADMISSION_TARGET_SECONDS): predicted queue wait {wait.seconds:.2f}s",
                retry_after=self._retry(wait.seconds - self.target_seconds),
                reason=REASON_QUEUE_WAIT,
                metadata={"predicted_wait_s": f"{wait.seconds:.3f}", "target_s": f"{self.target_seconds:g}"},
            )
        finish = wait.seconds + wait.service_seconds
        if finish > deadline_left:
            how = f"(queue {wait.seconds:.2f}s, then at the engine's step time)"
            return self._too_slow(finish, deadline_left, how)
        return None

    def _too_slow(self, expected: float, deadline_left: float, how: str) -> ResourceExhausted:
        """The one deadline refusal: the request would not finish in time (`expected` seconds,
        estimated as `how` says), so it is refused now rather than run into the caller's
        deadline. Retry when the excess has passed (`_retry`: at least MIN_RETRY_S, at most a window)."""
        return ResourceExhausted(
            f"expected to take {expected:.1f}s {how}; {deadline_left:.1f}s of the deadline left",
            retry_after=self._retry(expected - deadline_left),
            reason=REASON_DEADLINE,
        )

    def _retry(self, seconds: float) -> float:
        return round(min(self.config.window_seconds, max(MIN_RETRY_S, seconds)), 3)

    def _dispatched(self, route: str, ticket: Ticket | None) -> None:
        load = self.loads.model(route)
        load.dispatched()
        if ticket is not None:
            ticket.on_finish = lambda t: load.ended(t.output_tokens, t.seconds_per_token())


__all__ = ["AdmissionController", "Ask", "Window"]
