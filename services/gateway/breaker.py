"""Circuit breaker per downstream with resilience4j semantics (gateway domain logic, no gRPC here).

CLOSED
    Every call is allowed; outcomes go into a count-based sliding window of the last
    `window_size` calls. Once it holds at least `minimum_calls` (capped at `window_size`), the
    breaker opens when the failure rate >= `failure_rate_threshold` or the slow-call rate >=
    `slow_call_rate_threshold` (slow: duration >= `slow_call_duration`; a slow failure counts in
    both rates). `consecutive_failures` failures in a row open it at once, whatever the window
    holds: a frozen service whose few callers each wait out a hop budget is cut off after those
    calls, not after `minimum_calls` of them.
OPEN
    Calls are rejected with BreakerOpen (UNAVAILABLE, reason CIRCUIT_OPEN, retry_after = time left)
    for `wait_in_open` seconds, then the breaker turns HALF_OPEN on the next look at it. A probe
    that finds the downstream answering again (`probe_passed`, the gateway's health check while
    the breaker is open) turns it HALF_OPEN before that, unless the breaker opened because its
    half-open trials failed: then it waits the whole `wait_in_open`, so a service that answers
    health checks but fails calls is not tried again on every probe. A probe that gets no answer
    (`probe_failed`) starts the wait again: no trial calls are spent on a service that is known
    not to answer, so a frozen service is not tried, failed and shut out for a whole wait just
    before it comes back.
HALF_OPEN
    `permitted_calls_in_half_open` trial calls are allowed, the rest rejected (retry_after =
    `wait_in_open`). When all trials have reported, the breaker closes (fresh window) if their
    failure and slow-call rates are below the thresholds, else opens again.

Outcomes of calls admitted under an earlier state (a permit from before a transition) are ignored,
so a slow call started while CLOSED cannot decide a HALF_OPEN trial. A permit released without an
outcome (cancelled call, or the caller's own deadline) frees its trial slot. What a call's
"duration" is belongs to the caller: the gateway reports a stream's time to first message and
its longest stall between messages, never its whole length (see `services/gateway/upstream.py`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from llmesh.errors import Unavailable
from llmesh.settings import BreakerSettings

log = logging.getLogger(__name__)

REASON_CIRCUIT_OPEN = "CIRCUIT_OPEN"


class State(enum.StrEnum):
    """The one vocabulary of a breaker's state: callers compare members (`is State.OPEN`), never
    their strings; the value is the state's name in logs, spans and metric labels, `level` its
    value in the state gauge."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def level(self) -> int:
        """The breaker-state gauge's value: 0 closed, 1 half-open, 2 open."""
        return _LEVELS[self]


_LEVELS = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}


# Transition reasons (low cardinality: fit for metric labels).
FAILURE_RATE = "failure_rate"
SLOW_CALL_RATE = "slow_call_rate"
WAIT_ELAPSED = "wait_elapsed"
TRIALS_PASSED = "trials_passed"
CONSECUTIVE_FAILURES = "consecutive_failures"
PROBE_PASSED = "probe_passed"
RESET = "reset"

TransitionListener = Callable[[State, State, str], None]


class BreakerOpen(Unavailable):
    """The downstream's circuit is open (or its half-open trials are taken)."""

    def __init__(self, name: str, state: State, retry_after: float) -> None:
        retry_after = max(0.0, retry_after)
        super().__init__(
            f"{name}: circuit {state.value}, not calling it; retry in {retry_after:.2f}s",
            reason=REASON_CIRCUIT_OPEN,
            retry_after=retry_after,
        )
        self.name = name
        self.state = state
        self.metadata = {"downstream": name, "state": state.value}


@dataclass(frozen=True)
class BreakerConfig:
    window_size: int = 20
    minimum_calls: int = 10
    failure_rate_threshold: float = 0.5  # fraction in (0, 1]
    slow_call_rate_threshold: float = 0.8  # fraction in (0, 1]
    slow_call_duration: float = 30.0  # seconds
    wait_in_open: float = 5.0  # seconds
    permitted_calls_in_half_open: int = 3
    consecutive_failures: int = 5  # 0: only the rates open the breaker

    @classmethod
    def from_settings(cls, settings: BreakerSettings) -> BreakerConfig:
        """From the gateway's LLMESH_BREAKER_* settings."""
        return cls(
            window_size=settings.window,
            minimum_calls=settings.minimum_calls,
            failure_rate_threshold=settings.failure_rate,
            slow_call_rate_threshold=settings.slow_call_rate,
            slow_call_duration=settings.slow_call_seconds,
            wait_in_open=settings.wait_seconds,
            permitted_calls_in_half_open=settings.half_open_calls,
            consecutive_failures=settings.consecutive_failures,
        )

    def __post_init__(self) -> None:
        if self.window_size < 1:
            raise ValueError("window_size must be >= 1")
        if self.minimum_calls < 1:
            raise ValueError("minimum_calls must be >= 1")
        for name in ("failure_rate_threshold", "slow_call_rate_threshold"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if not self.slow_call_duration > 0:
            raise ValueError("slow_call_duration must be > 0")
        if not self.wait_in_open >= 0:
            raise ValueError("wait_in_open must be >= 0")
        if self.permitted_calls_in_half_open < 1:
            raise ValueError("permitted_calls_in_half_open must be >= 1")
        if self.consecutive_failures < 0:
            raise ValueError("consecutive_failures must be >= 0")


@dataclass(frozen=True)
class BreakerMetrics:
    state: State
    calls: int  # outcomes in the current window (trials when half-open)
    failed: int
    slow: int
    failure_rate: float | None  # None until minimum_calls are buffered
    slow_call_rate: float | None
    not_permitted: int  # calls rejected since creation


def _all_exceptions(exc: BaseException) -> bool:
    return True


class Permit:
    """Permission for one call; report its outcome once (later reports are ignored)."""

    __slots__ = ("_breaker", "_done", "_entry", "_generation", "started", "trial")

    def __init__(self, breaker: CircuitBreaker, generation: int, trial: bool = False) -> None:
        self._breaker = breaker
        self._generation = generation
        self._done = False
        # The window entry its success went into, so a call that ends in a failure after a
        # success was reported early (a stream's stall) is counted as the failure it was.
        self._entry: list[bool] | None = None
        self.started = breaker.clock()
        # A half-open trial: callers report it as soon as they can judge (a stream: its first
        # message), so trials are short whatever the length of the call.
        self.trial = trial

    def _elapsed(self, duration: float | None) -> float:
        return self._breaker.clock() - self.started if duration is None else duration

    def success(self, duration: float | None = None) -> None:
        """The call succeeded; duration defaults to the time since the permit was granted."""
        if not self._done:
            self._done = True
            self._entry = self._breaker._record(False, self._elapsed(duration), self._generation)

    def failure(self, duration: float | None = None) -> None:
        """The call failed; after a success reported early (a stall), that success turns into
        this failure."""
        if not self._done:
            self._done = True
            self._breaker._record(True, self._elapsed(duration), self._generation)
        elif self._entry is not None:
            entry, self._entry = self._entry, None
            self._breaker._amend_failure(entry, self._generation)

    def release(self) -> None:
        """No outcome (e.g. the call was cancelled): frees a half-open trial slot."""
        if not self._done:
            self._done = True
            self._breaker._release(self._generation)


class _Guard:
    """`async with breaker.guard():` (or plain `with`): acquire, time and record the call."""

    __slots__ = ("_breaker", "permit")

    def __init__(self, breaker: CircuitBreaker) -> None:
        self._breaker = breaker
        self.permit: Permit | None = None

    def __enter__(self) -> Permit:
        self.permit = self._breaker.acquire()
        return self.permit

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        permit = self.permit
        assert permit is not None
        if exc is None:
            permit.success()
        elif not isinstance(exc, Exception):  # CancelledError, KeyboardInterrupt: no verdict
            permit.release()
        elif self._breaker.is_failure(exc):
            permit.failure()
        else:  # e.g. INVALID_ARGUMENT: the downstream answered, so it is healthy
            permit.success()

    async def __aenter__(self) -> Permit:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)


class CircuitBreaker:
    """One downstream's breaker. Used from one asyncio loop; no awaits inside."""

    def __init__(
        self,
        name: str,
        config: BreakerConfig | None = None,
        *,
        is_failure: Callable[[BaseException], bool] = _all_exceptions,
        clock: Callable[[], float] = time.monotonic,
        on_transition: list[TransitionListener] | None = None,
    ) -> None:
        self.name = name
        self.config = config or BreakerConfig()
        self.is_failure = is_failure
        self.clock = clock
        self.on_transition: list[TransitionListener] = list(on_transition or [])
        self.transitions: Counter[tuple[State, State]] = Counter()
        self.not_permitted = 0
        self._state = State.CLOSED
        self._generation = 0
        self._opened_at = 0.0
        self._window: deque[list[bool]] = deque(maxlen=self.config.window_size)
        self._trials_granted = 0
        self._failures_in_a_row = 0
        # Whether a passing probe may end the current OPEN period early (not after failed trials).
        self._probe_may_close = False

    # --- state -----------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        self._maybe_half_open()
        return self._state

    @property
    def retry_after(self) -> float:
        """Seconds until a call may be tried again (0 when one is allowed now)."""
        state = self.state
        if state is State.OPEN:
            return max(0.0, self._opened_at + self.config.wait_in_open - self.clock())
        if state is State.HALF_OPEN and self._trials_granted >= self.config.permitted_calls_in_half_open:
            return self.config.wait_in_open
        return 0.0

    def metrics(self) -> BreakerMetrics:
        state = self.state
        calls = len(self._window)
        failed = sum(1 for f, _ in self._window if f)
        slow = sum(1 for _, s in self._window if s)
        enough = calls >= self._needed()
        return BreakerMetrics(
            state=state,
            calls=calls,
            failed=failed,
            slow=slow,
            failure_rate=failed / calls if enough else None,
            slow_call_rate=slow / calls if enough else None,
            not_permitted=self.not_permitted,
        )

    def reset(self) -> None:
        """Back to CLOSED with an empty window."""
        self._transition(State.CLOSED, RESET)

    @property
    def probe_may_half_open(self) -> bool:
        """Whether a passing probe would end the current OPEN period (see `probe_passed`)."""
        return self.state is State.OPEN and self._probe_may_close

    def probe_failed(self) -> None:
        """A health probe got no answer: an OPEN breaker's wait starts again."""
        if self.state is State.OPEN:
            self._opened_at = self.clock()

    def probe_passed(self) -> bool:
        """A health probe found the downstream answering: an OPEN breaker turns HALF_OPEN now
        (its trials decide), unless it opened because trials failed. Returns whether it did."""
        if not self.probe_may_half_open:
            return False
        self._transition(State.HALF_OPEN, PROBE_PASSED)
        return True

    # --- permission ------------------------------------------------------------------------------

    def try_acquire(self) -> Permit | None:
        state = self.state
        if state is State.OPEN or (
            state is State.HALF_OPEN and self._trials_granted >= self.config.permitted_calls_in_half_open
        ):
            self.not_permitted += 1
            return None
        if state is State.HALF_OPEN:
            self._trials_granted += 1
        return Permit(self, self._generation, trial=state is State.HALF_OPEN)

    def acquire(self) -> Permit:
        """A permit for one call, or BreakerOpen."""
        permit = self.try_acquire()
        if permit is None:
            raise BreakerOpen(self.name, self._state, self.retry_after)
        return permit

    def allow(self) -> bool:
        """Permission without a token; report with record_success/record_failure (HALF_OPEN: takes a
        trial slot)."""
        return self.try_acquire() is not None

    def record_success(self, duration: float) -> None:
        self._record(False, duration, self._generation)

    def record_failure(self, duration: float) -> None:
        self._record(True, duration, self._generation)

    def guard(self) -> _Guard:
        """``async with breaker.guard(): await call()`` - raises BreakerOpen when not allowed, records
        success/failure (per is_failure) and duration; cancellation records nothing."""
        return _Guard(self)

    # --- internals -------------------------------------------------------------------------------

    def _needed(self) -> int:
        if self._state is State.HALF_OPEN:
            return self.config.permitted_calls_in_half_open
        return min(self.config.minimum_calls, self.config.window_size)

    def _maybe_half_open(self) -> None:
        if self._state is State.OPEN and self.clock() >= self._opened_at + self.config.wait_in_open:
            self._transition(State.HALF_OPEN, WAIT_ELAPSED)

    def _release(self, generation: int) -> None:
        if generation == self._generation and self._state is State.HALF_OPEN and self._trials_granted > 0:
            self._trials_granted -= 1

    def _record(self, failed: bool, duration: float, generation: int) -> list[bool] | None:
        """Records an outcome; returns its window entry ([failed, slow]) or None when ignored."""
        self._maybe_half_open()
        if generation != self._generation or self._state is State.OPEN:
            return None  # a call admitted under an earlier state, or one that slipped past OPEN
        cfg = self.config
        entry = [failed, duration >= cfg.slow_call_duration]
        self._window.append(entry)
        self._failures_in_a_row = self._failures_in_a_row + 1 if failed else 0
        self._judge()
        return entry

    def _amend_failure(self, entry: list[bool], generation: int) -> None:
        """A success recorded early turned out a failure (a stream that stalled, then failed)."""
        self._maybe_half_open()
        if generation != self._generation or self._state is State.OPEN or entry[0]:
            return
        if not any(e is entry for e in self._window):
            return  # it left the window meanwhile
        entry[0] = True
        self._failures_in_a_row += 1
        self._judge()

    def _judge(self) -> None:
        cfg = self.config
        if (
            self._state is State.CLOSED
            and cfg.consecutive_failures
            and self._failures_in_a_row >= cfg.consecutive_failures
        ):
            self._transition(State.OPEN, CONSECUTIVE_FAILURES)
            return
        calls = len(self._window)
        if calls < self._needed():
            return
        failure_rate = sum(1 for f, _ in self._window if f) / calls
        slow_rate = sum(1 for _, s in self._window if s) / calls
        if failure_rate >= cfg.failure_rate_threshold:
            self._transition(State.OPEN, FAILURE_RATE)
        elif slow_rate >= cfg.slow_call_rate_threshold:
            self._transition(State.OPEN, SLOW_CALL_RATE)
        elif self._state is State.HALF_OPEN:
            self._transition(State.CLOSED, TRIALS_PASSED)

    def _transition(self, new: State, reason: str) -> None:
        old = self._state
        self._state = new
        self._generation += 1
        self._window = deque(
            maxlen=self.config.permitted_calls_in_half_open if new is State.HALF_OPEN else self.config.window_size
        )
        self._trials_granted = 0
        self._failures_in_a_row = 0
        if new is State.OPEN:
            self._opened_at = self.clock()
            self._probe_may_close = old is State.CLOSED
        self.transitions[(old, new)] += 1
        for listener in list(self.on_transition):
            try:
                listener(old, new, reason)
            except Exception:
                log.exception("breaker %s: on_transition listener failed", self.name)


__all__ = [
    "CONSECUTIVE_FAILURES",
    "FAILURE_RATE",
    "PROBE_PASSED",
    "REASON_CIRCUIT_OPEN",
    "RESET",
    "SLOW_CALL_RATE",
    "TRIALS_PASSED",
    "WAIT_ELAPSED",
    "BreakerConfig",
    "BreakerMetrics",
    "BreakerOpen",
    "CircuitBreaker",
    "Permit",
    "State",
]
