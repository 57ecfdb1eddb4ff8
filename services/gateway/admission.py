"""Admission by request weight over a sliding time window (gateway domain logic, no gRPC here).

Weight
    ``request_weight(input_tokens, max_new_tokens) = max(1, input_tokens) * max(1, max_new_tokens)``:
    prompt length times the generation budget, a simple proxy for the KV-cache x decode-steps a
    request may hold. Each factor counts at least 1 so every admitted request costs something.
    Cache hits cost nothing: the gateway does not call admission for them.

Window
    Every admitted weight is kept for ``window_seconds`` (an entry admitted at ``t`` counts while
    ``now < t + window_seconds``). A request is admitted when, after adding it,

    * global occupancy <= ``budget * lane_share(lane)`` (the lane ceiling: ``interactive`` may use the
      whole budget, ``batch`` is admitted only while the total stays under its fraction, so
      interactive traffic always keeps ``1 - batch_share`` of the budget as headroom), and
    * the tenant's occupancy <= its budget: the explicit override from ``tenant_budgets`` or
      ``tenant_share * budget`` (never more than ``budget``), so one tenant's burst cannot starve others.

    A refusal raises ``ResourceExhausted`` at once with ``retry_after`` = the exact time until enough
    old entries leave the window for the request to fit (if nothing else is admitted meanwhile).
    A request that can never fit raises ``RequestTooHeavy`` (no retry pushback); ``fits_ever`` tells
    beforehand.

Degrade
    ``plan`` caps ``max_new_tokens`` down (not below ``min_new_tokens``) to the largest value that fits
    now, before refusing.

Reservation and refund
    ``plan`` reserves the request's whole weight (input x max_new_tokens) and returns it as a
    ``Ticket``. As tokens come back the ticket reports progress; ``Ticket.finish`` (on every exit
    path: finished early, failed, refused downstream, breaker open, cancelled) refunds from the
    window what was not used, so a request that stops early, or never ran, pays only for what it
    generated and a retry does not pay twice.

Weight in flight
    Besides the rate, the weight admitted and not yet generated is bounded, per model, by a limit
    learned from what inference is measured to deliver (``CapacityLimit``): the larger of
    throughput x target latency (Little's law) and the weight in flight the model has been seen
    to carry without queueing (judged by its time to first token). ``budget`` caps it; without
    ``adaptive`` the cap is the limit.

``WeightWindow`` is the in-process window (sync, no awaits). ``RedisWeightWindow`` has the same
methods as coroutines and enforces one budget across gateway replicas with a Redis sorted set and
an atomic Lua script; when Redis is unreachable it falls back to its local ``WeightWindow``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmesh.errors import LlmeshError, ResourceExhausted
from llmesh.settings import (  # parsers live with the settings; re-exported here
    _NAME,
    parse_budget,
    parse_lane_shares,
    parse_share,
    parse_tenant_budgets,
)

log = logging.getLogger(__name__)

INTERACTIVE = "interactive"
BATCH = "batch"
DEFAULT_LANES: Mapping[str, float] = {INTERACTIVE: 1.0, BATCH: 0.5}

REASON_BUDGET = "WEIGHT_BUDGET_EXCEEDED"
REASON_TENANT = "TENANT_BUDGET_EXCEEDED"
REASON_TOO_HEAVY = "REQUEST_TOO_HEAVY"
REASON_IN_FLIGHT = "IN_FLIGHT_LIMIT"
REASON_DEADLINE = "DEADLINE_TOO_SHORT"

SOURCE_LOCAL = "local"
SOURCE_REDIS = "redis"
SOURCE_FALLBACK = "local_fallback"


def request_weight(input_tokens: int, max_new_tokens: int) -> int:
    """The admission weight of one generation request."""
    return max(1, int(input_tokens)) * max(1, int(max_new_tokens))


# --- configuration and results -------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionConfig:
    budget: float
    window_seconds: float = 10.0
    tenant_share: float = 0.5
    tenant_budgets: Mapping[str, float] = field(default_factory=dict)
    lanes: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_LANES))
    degrade: bool = True
    min_new_tokens: int = 16
    adaptive: bool = False
    target_seconds: float = 3.0
    initial_in_flight: float = 65536.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.budget) and self.budget > 0):
            raise ValueError(f"budget must be a finite number > 0, got {self.budget!r}")
        if not (math.isfinite(self.window_seconds) and self.window_seconds > 0):
            raise ValueError(f"window_seconds must be > 0, got {self.window_seconds!r}")
        if not 0 < self.tenant_share <= 1:
            raise ValueError(f"tenant_share must be in (0, 1], got {self.tenant_share!r}")
        if not self.lanes:
            raise ValueError("at least one lane is required")
        for name, share in self.lanes.items():
            if not _NAME.match(name) or not 0 < share <= 1:
                raise ValueError(f"lane {name!r}: share must be in (0, 1], got {share!r}")
        for name, value in self.tenant_budgets.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"tenant {name!r}: budget must be > 0, got {value!r}")
        if self.min_new_tokens < 1:
            raise ValueError(f"min_new_tokens must be >= 1, got {self.min_new_tokens!r}")
        object.__setattr__(self, "tenant_budgets", dict(self.tenant_budgets))
        object.__setattr__(self, "lanes", dict(self.lanes))

    @classmethod
    def from_settings(cls, settings: Any) -> AdmissionConfig:
        """From llmesh Settings holding the proposed LLMESH_ADMISSION_* variables (already parsed)."""
        return cls(
            budget=settings.admission_budget,
            window_seconds=settings.admission_window_seconds,
            tenant_share=settings.admission_tenant_share,
            tenant_budgets=settings.admission_tenant_budgets,
            lanes=settings.admission_lanes,
            degrade=settings.admission_degrade,
            min_new_tokens=settings.admission_min_new_tokens,
            adaptive=getattr(settings, "admission_adaptive", False),
            target_seconds=getattr(settings, "admission_target_seconds", 3.0),
            initial_in_flight=getattr(settings, "admission_initial_in_flight", 65536.0),
        )

    def lane_limit(self, lane: str) -> float:
        try:
            return self.budget * self.lanes[lane]
        except KeyError:
            raise ValueError(f"unknown lane {lane!r} (known: {', '.join(self.lanes)})") from None

    def tenant_limit(self, tenant: str | None) -> float:
        """The tenant's budget; ``None`` means a tenant without an explicit override."""
        explicit = self.tenant_budgets.get(tenant) if tenant is not None else None
        return min(self.budget, explicit if explicit is not None else self.tenant_share * self.budget)

    def max_weight(self, tenant: str | None = None, lane: str = INTERACTIVE) -> float:
        """The heaviest request the tenant can ever be admitted on this lane."""
        return min(self.lane_limit(lane), self.tenant_limit(tenant))


@dataclass(frozen=True)
class Admission:
    """An admitted request. ``occupancy``/``tenant_occupancy`` include it."""

    tenant: str
    lane: str
    weight: int
    occupancy: float
    budget: float
    tenant_occupancy: float
    tenant_budget: float
    max_new_tokens: int | None = None  # set by plan(): the (possibly capped) value to generate with
    degraded: bool = False  # plan() capped max_new_tokens
    source: str = SOURCE_LOCAL  # local | redis | local_fallback
    admitted: bool = True
    # The reservation to report progress on and finish (plan() only).
    ticket: Ticket | None = field(default=None, compare=False)


class Hold:
    """The predicted weight of a request that passed `precheck` and is on its way to `plan`
    (retrieval, tokenizer). Later prechecks and plans count it, so a burst that arrives together
    is shed at once instead of each request paying for its hops before finding the window full."""

    __slots__ = ("_window", "model", "released", "tenant", "weight")

    def __init__(self, window: WeightWindow, tenant: str, weight: int, model: str = "") -> None:
        self._window = window
        self.tenant = tenant
        self.weight = weight
        self.model = model
        self.released = False

    def release(self) -> None:
        """Idempotent; called before the exact admission and when the request ends."""
        if not self.released:
            self.released = True
            self._window._unhold(self)


class RequestTooHeavy(ResourceExhausted):
    """The request exceeds the whole budget it is subject to: it can never be admitted, so no retry
    pushback is sent. The gateway may map it to INVALID_ARGUMENT instead."""

    def __init__(self, message: str, *, metadata: Mapping[str, str]) -> None:
        super().__init__(message, retry_after=0.0, reason=REASON_TOO_HEAVY, metadata=metadata)

    def details(self) -> list[Any]:
        return LlmeshError.details(self)  # ErrorInfo only, no RetryInfo

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        return LlmeshError.trailing_metadata(self)  # no grpc-retry-pushback-ms


def _num(value: float) -> str:
    """Exact text of a weight: '100' for integral values, else the shortest round-trip float."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True)
class _Request:
    tenant: str
    lane: str
    unit: int  # weight per generated token (or the whole weight for admit())
    want: int  # max_new_tokens asked for (1 for admit())
    least: int  # smallest acceptable max_new_tokens
    planned: bool  # from plan(): report max_new_tokens


def _request(
    config: AdmissionConfig, tenant: str, unit: int, want: int, lane: str, degrade: bool, planned: bool
) -> _Request:
    if unit < 1 or want < 1:
        raise ValueError("weight must be >= 1")
    least = min(want, config.min_new_tokens) if degrade else want
    req = _Request(tenant, lane, unit, want, least, planned)
    cap = config.max_weight(tenant, lane)  # also validates the lane
    if unit * least > cap:
        meta = {
            "weight": str(unit * want),
            "max_weight": _num(cap),
            "tenant": tenant,
            "lane": lane,
        }
        text = (
            f"request weight {unit * least} exceeds {_num(cap)}, the most tenant {tenant!r} "
            f"may ever use on lane {lane!r}"
        )
        if planned:
            meta["max_new_tokens_limit"] = str(int(cap // unit))
            text += f"; max_new_tokens would have to be <= {int(cap // unit)}"
        raise RequestTooHeavy(text, metadata=meta)
    return req


def _refusal(
    config: AdmissionConfig,
    req: _Request,
    scope: str,
    occupancy: float,
    retry_after: float,
    flight_limit: float = math.inf,
) -> ResourceExhausted:
    weight = req.unit * req.least
    if scope == "in_flight":
        limit, reason, what = flight_limit, REASON_IN_FLIGHT, "in flight"
        text = f"{what}: weight {weight} + {_num(round(occupancy))} in flight exceeds the limit {_num(round(limit))}"
    else:
        limit = config.tenant_limit(req.tenant) if scope == "tenant" else config.lane_limit(req.lane)
        reason = REASON_TENANT if scope == "tenant" else REASON_BUDGET
        what = f"tenant {req.tenant!r}" if scope == "tenant" else f"lane {req.lane!r}"
        text = (
            f"{what}: weight {weight} + {_num(occupancy)} admitted in the last {config.window_seconds:g}s or on its "
            f"way exceeds {_num(limit)}"
        )
    return ResourceExhausted(
        f"{text}; retry in {retry_after:.3f}s",
        retry_after=retry_after,
        reason=reason,
        metadata={
            "weight": str(weight),
            "occupancy": _num(round(occupancy) if scope == "in_flight" else occupancy),
            "budget": _num(round(limit) if scope == "in_flight" else limit),
            "scope": scope,
            "tenant": req.tenant,
            "lane": req.lane,
        },
    )


# --- in-process window ---------------------------------------------------------------------------


# Over its life an admitted request's weight not yet generated falls from its whole reservation to
# nothing: half of it on average. By Little's law the weight in flight is then
# throughput x time in system x this share.
REMAINING_SHARE = 0.5
# The learned limit never drops below initial / this: a few typical requests. Higher, it outweighs
# what a slow machine delivers (at 3,000 weight/s, 16,384 in flight is 11 s in the system).
FLOOR_DIVISOR = 16

# The queueing judge (see CapacityLimit): a judging period's median time to first token is
# "not queueing" while it stays within QUEUE_TOLERANCE x the baseline + QUEUE_SLACK_S, the
# baseline being the lowest period median of the last BASELINE_S (a median, not the fastest
# sample: in a churning batch first tokens spread over a few steps without any queue).
QUEUE_TOLERANCE = 2.0
QUEUE_SLACK_S = 0.05
# ...and, where tokens stream, while it stays within QUEUE_STEPS x the period's median time
# between tokens: a first token waits for the step running and its own prefill, a few steps,
# however long a step takes at the batch size; a queue makes it wait for whole answers.
QUEUE_STEPS = 6.0
BASELINE_S = 120.0
JUDGE_S = 1.0  # a period lasts at least this and holds JUDGE_SAMPLES first tokens...
JUDGE_SAMPLES = 3
JUDGE_MAX_S = 5.0  # ...or lasts this long with at least one
# What the model carried without queueing is allowed again with this headroom, so the limit keeps
# probing upwards while time to first token stays flat; queueing halves it (from at most the
# period's peak), so a queue drains within a few periods: CARRIED_HEADROOM x CARRIED_BACKOFF < 1.
CARRIED_HEADROOM = 1.25
CARRIED_BACKOFF = 0.5


class CapacityLimit:
    """How much weight one model may have in flight from this gateway, learned from what it is
    measured to deliver.

    Throughput is the weight generated per second (input tokens x tokens streamed back), measured
    only while requests are in flight and smoothed over samples of `sample_seconds`. By Little's
    law, with each request's weight in flight falling from its reservation to nothing as its tokens
    come back (half of it on average, `REMAINING_SHARE`), a limit of
    ``throughput x target_seconds / 2`` keeps a request's time in the system near
    `target_seconds`: below capacity, requests finish faster than the target, so the limit sits
    above what is in flight and opens up as throughput follows demand; at capacity, the queue
    stays bounded and the surplus is shed. A cold gateway allows `initial` until it has measured;
    the limit never drops below `initial / 16` (and one request always runs when none is in
    flight), so a gateway that measured nothing recently can still learn. `cap` bounds it all;
    without `adaptive` the cap is the limit.

    Time in the system is not queueing, though: a batching engine (vLLM, or ours on a GPU) runs
    more streams side by side, each slower, and its requests may spend longer than the target in
    the system while none of them waits. So the limit is also at least what the model has been
    seen to carry without queueing, judged like Envoy's adaptive concurrency and Netflix's
    gradient limits judge round trips, with the time to first token (admission to first token:
    the queue and the prefill) as the signal. Per judging period (`JUDGE_S`, `JUDGE_SAMPLES`),
    if the median time to first token stays within `QUEUE_TOLERANCE` x its baseline (the lowest
    period median of the last `BASELINE_S`) plus `QUEUE_SLACK_S`, or within `QUEUE_STEPS` x the
    period's median time between tokens (a step grows with the batch: at 32 streams vLLM's first
    tokens take 3x longer than at one, with no queue), the peak weight in flight
    during the period was carried without queueing: `carried` rises to it, and the limit allows
    `CARRIED_HEADROOM` x that, so it keeps probing upwards while the first tokens stay prompt.
    When they slow down, `carried` halves (from at most that period's peak: `CARRIED_BACKOFF`)
    until Little's law takes over again. A request's deadline is judged apart (`drain_seconds`)."""

    __slots__ = (
        "_busy",
        "_done",
        "_itls",
        "_last",
        "_medians",
        "_peak",
        "_period_start",
        "_ttfts",
        "adaptive",
        "alpha",
        "cap",
        "carried",
        "held",
        "in_flight",
        "initial",
        "requests",
        "sample_seconds",
        "streaming",
        "target_seconds",
        "throughput",
    )

    def __init__(
        self,
        *,
        cap: float,
        adaptive: bool,
        target_seconds: float,
        initial: float,
        now: float,
        sample_seconds: float = 0.5,
        alpha: float = 0.3,
    ) -> None:
        self.cap = cap
        self.adaptive = adaptive
        self.target_seconds = target_seconds
        self.initial = min(initial, cap)
        self.sample_seconds = sample_seconds
        self.alpha = alpha
        self.in_flight = 0.0  # reserved weight of admitted requests not yet generated
        self.requests = 0  # admitted requests not yet finished
        self.streaming = 0  # of those, the ones whose tokens have started to come back
        self.held = 0  # weight held by requests between precheck and admission
        self.throughput = 0.0  # weight per second while busy; 0 until measured
        self._busy = 0.0
        self._done = 0.0
        self._last = now
        self.carried = 0.0  # weight in flight seen carried without queueing; 0 until judged
        self._ttfts: list[float] = []  # this judging period's times to first token
        self._itls: list[float] = []  # and its times between tokens
        self._peak = 0.0  # this period's highest weight in flight
        self._period_start = now
        self._medians: deque[tuple[float, float]] = deque()  # (period end, its median time to first token)

    def limit(self) -> float:
        if not self.adaptive:
            return self.cap
        if not self.throughput:
            little = self.initial
        else:
            little = max(self.initial / FLOOR_DIVISOR, self.throughput * self.target_seconds * REMAINING_SHARE)
        return min(self.cap, max(little, self.carried * CARRIED_HEADROOM))

    def admitted(self, weight: float) -> None:
        """A request of `weight` went in flight."""
        self.in_flight += weight
        self.requests += 1
        self._peak = max(self._peak, self.in_flight)

    def first_token(self, now: float, seconds: float) -> bool | None:
        """A request's first token came back `seconds` after its admission; the verdict of the
        judging period it ended, if it ended one (see `judge`)."""
        if not self._ttfts and now - self._period_start > JUDGE_MAX_S:
            self._period_start = now  # a period with no first tokens yet starts with its first
        self._ttfts.append(seconds)
        return self.judge(now)

    def between_tokens(self, seconds: float) -> None:
        """A stream's next tokens came `seconds` per token after its previous ones."""
        self._itls.append(seconds)

    def baseline(self) -> float | None:
        """The lowest period median time to first token of the last BASELINE_S (None before the
        first period)."""
        return min((median for _, median in self._medians), default=None)

    def judge(self, now: float) -> bool | None:
        """Ends the judging period if it is due: whether the model queued in it (None: not due)."""
        samples, age = len(self._ttfts), now - self._period_start
        if not samples or not ((age >= JUDGE_S and samples >= JUDGE_SAMPLES) or age >= JUDGE_MAX_S):
            return None
        median = sorted(self._ttfts)[samples // 2]
        while self._medians and self._medians[0][0] < now - BASELINE_S:
            self._medians.popleft()
        self._medians.append((now, median))
        base = self.baseline()
        assert base is not None
        queued = median > QUEUE_TOLERANCE * base + QUEUE_SLACK_S
        if queued and self._itls:
            queued = median > QUEUE_STEPS * sorted(self._itls)[len(self._itls) // 2]
        if queued:
            self.carried = CARRIED_BACKOFF * min(self.carried, self._peak)
        else:
            self.carried = max(self.carried, self._peak)
        self._ttfts.clear()
        self._itls.clear()
        self._peak = self.in_flight
        self._period_start = now
        return queued

    def room(self, with_holds: bool) -> float:
        taken = self.in_flight + (self.held if with_holds else 0)
        if not self.requests and not (with_holds and self.held):
            return math.inf if self.adaptive else self.cap  # work-conserving: one always runs
        return self.limit() - taken

    def advance(self, now: float, generated: float = 0.0) -> None:
        """Time passes (and `generated` weight came back): busy time only counts while requests
        are streaming, so neither idle time nor a prefill dilutes the throughput, and a stall
        mid-stream lowers it."""
        if self.streaming:
            self._busy += max(0.0, now - self._last)
        self._last = now
        self._done += generated
        if self._busy >= self.sample_seconds:
            rate = self._done / self._busy
            self.throughput = rate if not self.throughput else self.throughput + self.alpha * (rate - self.throughput)
            self._busy = self._done = 0.0

    def drain_seconds(self, extra: float) -> float:
        """A request of weight `extra` joining now: its expected time in the system at the measured
        throughput (the weight in flight is about REMAINING_SHARE of throughput x time in system,
        and the request's own weight comes on top); 0 until measured."""
        if self.throughput <= 0 or not self.adaptive:
            return 0.0
        return ((self.in_flight + self.held) / REMAINING_SHARE + extra) / self.throughput

    def retry_after(self, need: float, window_seconds: float) -> float:
        """Time for `need` weight in flight to drain at the measured throughput."""
        if self.throughput <= 0:
            return min(window_seconds, self.target_seconds)
        return min(window_seconds, max(0.05, need / self.throughput))


class Ticket:
    """An admitted request's reservation. `progress` as tokens come back; `finish` once on every
    exit path: the weight not generated leaves the flight and is refunded from the window."""

    __slots__ = (
        "_entry",
        "_window",
        "admitted_at",
        "finished",
        "last_at",
        "model",
        "on_refund",
        "reserved",
        "streaming",
        "tenant",
        "unit",
        "used",
    )

    def __init__(
        self,
        window: WeightWindow,
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
        self._entry = entry
        self.tenant = tenant
        self.model = model
        self.unit = unit
        self.reserved = reserved
        self.used = 0
        self.finished = False
        self.streaming = False
        # Called with the refunded weight (a cluster window refunds it in Redis too).
        self.on_refund: Callable[[int], None] | None = None

    def progress(self, tokens: int) -> None:
        """`tokens` more were generated."""
        if self.finished or tokens <= 0:
            return
        step = min(self.unit * tokens, self.reserved - self.used)
        self.used += step
        self._window._progressed(self, step)

    def finish(self) -> int:
        """Idempotent; returns the weight refunded."""
        if self.finished:
            return 0
        self.finished = True
        refund = self.reserved - self.used
        self._window._finished(self, refund)
        if refund and self.on_refund is not None:
            self.on_refund(refund)
        return refund


class _Series:
    """Entries [timestamp, weight] in time order with their running sum. An entry may shrink
    (refund) while it is in the window."""

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: deque[list[float]] = deque()
        self.total = 0

    def trim(self, cutoff: float) -> None:
        entries = self.entries
        while entries and entries[0][0] <= cutoff:
            self.total -= int(entries.popleft()[1])

    def add(self, ts: float, weight: int, entry: list[float] | None = None) -> list[float]:
        entry = entry if entry is not None else [ts, weight]
        self.entries.append(entry)
        self.total += weight
        return entry

    def leaves_at(self, need: float) -> float | None:
        """Timestamp of the entry whose departure frees `need` weight (oldest first)."""
        freed = 0.0
        for ts, weight in self.entries:
            freed += weight
            if freed >= need:
                return ts
        return None


def _promised(req: _Request, held: int) -> int:
    """Room in the learned in-flight limit owed to a request that held `held` weight since its
    precheck: what it held, or its least admissible weight when its exact size outgrew the
    prediction by at most 2x (capping absorbs the rest), so the prediction's error does not turn
    into a refusal after its hops."""
    if held <= 0:
        return 0
    least = req.unit * req.least
    return max(held, least) if least <= 2 * held else held


class WeightWindow:
    """Sliding-window weight admission in one process, with the weight in flight bounded per model.
    Sync and lock-protected (no awaits)."""

    def __init__(self, config: AdmissionConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._all = _Series()
        self._tenants: dict[str, _Series] = {}
        self._held = 0
        self._held_by_tenant: dict[str, int] = {}
        self._capacity: dict[str, CapacityLimit] = {}
        self._lock = threading.Lock()
        self.source = SOURCE_LOCAL

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(self.config.lanes)

    def fits_ever(self, weight: int, tenant: str | None = None, lane: str = INTERACTIVE) -> bool:
        return weight <= self.config.max_weight(tenant, lane)

    def max_weight(self, tenant: str | None = None, lane: str = INTERACTIVE) -> float:
        return self.config.max_weight(tenant, lane)

    def capacity(self, model: str = "") -> CapacityLimit:
        """The in-flight limit learned for `model` (created on first use)."""
        found = self._capacity.get(model)
        if found is None:
            cfg = self.config
            found = self._capacity[model] = CapacityLimit(
                cap=cfg.budget,
                adaptive=cfg.adaptive,
                target_seconds=cfg.target_seconds,
                initial=cfg.initial_in_flight,
                now=self.clock(),
            )
        return found

    def admit(self, tenant: str, weight: int, lane: str = INTERACTIVE) -> Admission:
        """Records `weight` or raises ResourceExhausted / RequestTooHeavy."""
        return self._take(_request(self.config, tenant, weight, 1, lane, False, planned=False))

    def plan(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        allow_degrade: bool | None = None,
        hold: Hold | None = None,
        model: str = "",
    ) -> Admission:
        """Admits the request, capping max_new_tokens (not below min_new_tokens) when the full weight
        does not fit and degrading is allowed (default: config.degrade); else raises. `hold` is the
        request's own reservation from `precheck`: it is released, and the others' are counted.
        The admission carries a Ticket: report progress on it and finish it on every exit path."""
        degrade = self.config.degrade if allow_degrade is None else allow_degrade
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = _request(self.config, tenant, unit, want, lane, degrade, planned=True)
        if hold is None:
            return self._take(req, model=model)
        # The request's own reservation turns into its admission; the reservations of requests
        # still on their way are counted, so this one cannot take the room they were promised.
        # What it held is its own whatever changed meanwhile (the learned limit may have shrunk):
        # a request that passed the precheck is not refused after its hops for that.
        promised = 0 if hold.released else hold.weight
        hold.release()
        return self._take(req, with_holds=True, model=model, promised=promised)

    def precheck(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        hold: bool = False,
        model: str = "",
    ) -> Hold | None:
        """Raises what `plan` would raise for a request of at least this size, counting the holds
        of requests still on their way to `plan`; records nothing in the window.

        The gateway calls it with a prediction of the request's weight before its expensive hops
        (retrieval search, tokenizer), so an overloaded gateway sheds in milliseconds; a request
        that passes is still admitted exactly by `plan` once its true size is known. With
        `hold=True` a passing request reserves the weight it would be admitted with now (capped
        as `plan` would cap it) until the returned Hold is released or passed to `plan`: later
        prechecks and plans count it, so the request is not refused after its hops unless its
        true size outgrows the prediction by more than capping absorbs."""
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = _request(self.config, tenant, unit, want, lane, self.config.degrade, planned=True)
        fits = self._take(req, record=False, with_holds=True, model=model)
        if not hold:
            return None
        held = Hold(self, tenant, fits.weight, model)
        with self._lock:
            self._held += held.weight
            self._held_by_tenant[tenant] = self._held_by_tenant.get(tenant, 0) + held.weight
            self.capacity(model).held += held.weight
        return held

    def held(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._held if tenant is None else self._held_by_tenant.get(tenant, 0)

    def in_flight(self, model: str = "") -> float:
        with self._lock:
            return self.capacity(model).in_flight

    def _unhold(self, hold: Hold) -> None:
        with self._lock:
            self._held -= hold.weight
            self.capacity(hold.model).held -= hold.weight
            left = self._held_by_tenant.get(hold.tenant, 0) - hold.weight
            if left > 0:
                self._held_by_tenant[hold.tenant] = left
            else:
                self._held_by_tenant.pop(hold.tenant, None)

    def record(self, tenant: str, weight: int, lane: str = INTERACTIVE) -> list[float]:
        """Adds weight without checking (mirrors what a cluster window admitted); returns its entry."""
        with self._lock:
            now = self.clock()
            entry = self._all.add(now, weight)
            self._tenants.setdefault(tenant, _Series()).add(now, weight, entry)
            return entry

    def ticket(self, tenant: str, model: str, unit: int, weight: int, entry: list[float]) -> Ticket:
        """Puts an admitted weight in flight (a cluster window's admission, mirrored here)."""
        with self._lock:
            capacity = self.capacity(model)
            now = self.clock()
            capacity.advance(now)
            capacity.admitted(weight)
        return Ticket(self, tenant, model, unit, weight, entry, now)

    def refund(self, tenant: str, entry: list[float], weight: float) -> None:
        """Takes `weight` off an admitted entry still in the window."""
        with self._lock:
            cutoff = self.clock() - self.config.window_seconds
            self._all.trim(cutoff)
            weight = min(weight, entry[1])
            if weight <= 0 or entry[0] <= cutoff:
                return
            entry[1] -= weight
            self._all.total -= int(weight)
            series = self._tenant(tenant, cutoff)
            if series is not None:
                series.total -= int(weight)

    def _progressed(self, ticket: Ticket, weight: int) -> None:
        with self._lock:
            capacity = self.capacity(ticket.model)
            capacity.in_flight -= weight
            now = self.clock()
            if not ticket.streaming:
                # Its first tokens: the time until now was its queue and prefill, not a stall.
                capacity.advance(now)
                ticket.streaming = True
                capacity.streaming += 1
                capacity.first_token(now, now - ticket.admitted_at)
            elif weight > 0:
                capacity.between_tokens((now - ticket.last_at) * ticket.unit / weight)
            ticket.last_at = now
            capacity.advance(now, weight)

    def _finished(self, ticket: Ticket, refund: int) -> None:
        with self._lock:
            capacity = self.capacity(ticket.model)
            capacity.advance(self.clock())
            capacity.in_flight -= refund
            capacity.requests -= 1
            if ticket.streaming:
                capacity.streaming -= 1
        if refund:
            self.refund(ticket.tenant, ticket._entry, refund)

    def occupancy(self, tenant: str | None = None) -> float:
        with self._lock:
            cutoff = self.clock() - self.config.window_seconds
            self._all.trim(cutoff)
            if tenant is None:
                return self._all.total
            series = self._tenant(tenant, cutoff)
            return series.total if series else 0

    def _tenant(self, tenant: str, cutoff: float) -> _Series | None:
        series = self._tenants.get(tenant)
        if series is not None:
            series.trim(cutoff)
            if not series.entries:
                del self._tenants[tenant]
                return None
        return series

    def flight_room(self, req: _Request, model: str, with_holds: bool, own_hold: int = 0) -> tuple[int, float]:
        """(max_new_tokens that fit in the in-flight limit now, retry_after when fewer than
        `least` do): the cap a cluster window applies before asking Redis. `own_hold`: the
        request's own hold, not counted against it, and always room for it."""
        with self._lock:
            capacity = self.capacity(model)
            capacity.advance(self.clock())
            room = max(capacity.room(with_holds) + own_hold, _promised(req, own_hold))
            n = req.want if req.unit * req.want <= room else max(0, math.floor(room / req.unit))
            retry = capacity.retry_after(req.unit * req.least - room, self.config.window_seconds)
            return n, retry

    def _take(
        self, req: _Request, record: bool = True, with_holds: bool = False, model: str = "", promised: int = 0
    ) -> Admission:
        """`promised`: weight this request held since its precheck (already released): room for at
        least that much is its own."""
        config = self.config
        lane_limit, tenant_limit = config.lane_limit(req.lane), config.tenant_limit(req.tenant)
        with self._lock:
            now = self.clock()
            cutoff = now - config.window_seconds
            self._all.trim(cutoff)
            series = self._tenant(req.tenant, cutoff) or _Series()
            held = self._held if with_holds else 0
            tenant_held = self._held_by_tenant.get(req.tenant, 0) if with_holds else 0
            capacity = self.capacity(model)
            capacity.advance(now)
            # The learned limit owes a holder room for its prediction's error too; the budget, an
            # operator's hard cap, only what the holder held.
            flight = max(capacity.room(with_holds), _promised(req, promised))
            window_room = max(
                min(lane_limit - self._all.total - held, tenant_limit - series.total - tenant_held), promised
            )
            room = min(window_room, flight)
            n = req.want if req.unit * req.want <= room else math.floor(room / req.unit)
            if n >= req.least:
                weight = req.unit * n
                ticket = None
                if record:
                    entry = self._all.add(now, weight)
                    series.add(now, weight, entry)
                    self._tenants[req.tenant] = series
                    if req.planned:
                        capacity.admitted(weight)
                        ticket = Ticket(self, req.tenant, model, req.unit, weight, entry, now)
                return Admission(
                    tenant=req.tenant,
                    lane=req.lane,
                    weight=weight,
                    occupancy=self._all.total,
                    budget=config.budget,
                    tenant_occupancy=series.total,
                    tenant_budget=tenant_limit,
                    max_new_tokens=n if req.planned else None,
                    degraded=n < req.want,
                    source=self.source,
                    ticket=ticket,
                )
            weight = req.unit * req.least
            worst: tuple[float, str, float] = (-1.0, "", 0.0)
            for scope, s, limit, ahead in (
                ("global", self._all, lane_limit, held),
                ("tenant", series, tenant_limit, tenant_held),
            ):
                # Held weight will be admitted soon and stay a whole window: only entries already
                # in the window can leave before it.
                if s.total + ahead + weight > limit:
                    ts = s.leaves_at(s.total + ahead + weight - limit)
                    retry = config.window_seconds if ts is None else ts + config.window_seconds - now
                    if retry > worst[0]:  # ties: report the global scope
                        worst = (retry, scope, s.total + ahead)
            if weight > flight:
                retry = capacity.retry_after(weight - flight, config.window_seconds)
                if retry > worst[0]:
                    worst = (retry, "in_flight", capacity.in_flight + (capacity.held if with_holds else 0))
        raise _refusal(config, req, worst[1], worst[2], worst[0], capacity.limit())


# --- cluster-wide window on Redis ----------------------------------------------------------------

# KEYS: 1 global zset, 2 global sum, 3 tenant zset, 4 tenant sum
# ARGV: 1 now_us ("" = Redis TIME), 2 window_us, 3 mode (admit|peek), 4 unit, 5 want, 6 least,
#       7 lane limit, 8 tenant limit, 9 lane, 10 unique id
# Members are "<weight>:<lane>:<id>", scored by admission time in microseconds.
# admit -> {1, n, weight, occupancy, tenant_occupancy} or {0, weight, occupancy_of_scope, retry_us, scope}
# peek  -> {occupancy, tenant_occupancy}
_LUA = r"""
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local window = tonumber(ARGV[2])
local cutoff = string.format('%.0f', now - window)
local ttl = math.floor(window / 1000) * 2 + 1000

local function weight_of(member)
  return tonumber(string.match(member, '^(%d+):'))
end

local function trim(z, s)
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff)
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', cutoff) end
  if redis.call('ZCARD', z) == 0 then
    redis.call('DEL', s)
    return 0
  end
  local sum = tonumber(redis.call('GET', s))
  if sum == nil then
    sum = 0
    for _, m in ipairs(redis.call('ZRANGE', z, 0, -1)) do sum = sum + weight_of(m) end
  else
    for _, m in ipairs(old) do sum = sum - weight_of(m) end
  end
  if #old > 0 or redis.call('EXISTS', s) == 0 then
    redis.call('SET', s, string.format('%.0f', sum), 'PX', ttl)
  end
  return sum
end

local function leaves_at(z, need)
  local freed, start = 0, 0
  while true do
    local batch = redis.call('ZRANGE', z, start, start + 127, 'WITHSCORES')
    if #batch == 0 then return nil end
    for i = 1, #batch, 2 do
      freed = freed + weight_of(batch[i])
      if freed >= need then return tonumber(batch[i + 1]) end
    end
    start = start + 128
  end
end

local occ = trim(KEYS[1], KEYS[2])
local tocc = trim(KEYS[3], KEYS[4])
if ARGV[3] == 'peek' then return {occ, tocc} end

local unit, want, least = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lane_limit, tenant_limit = tonumber(ARGV[7]), tonumber(ARGV[8])
local room = math.min(lane_limit - occ, tenant_limit - tocc)
local n = want
if unit * want > room then n = math.floor(room / unit) end
if n >= least then
  local w = unit * n
  local member = string.format('%.0f', w) .. ':' .. ARGV[9] .. ':' .. ARGV[10]
  local score = string.format('%.0f', now)
  redis.call('ZADD', KEYS[1], score, member)
  redis.call('ZADD', KEYS[3], score, member)
  redis.call('SET', KEYS[2], string.format('%.0f', occ + w), 'PX', ttl)
  redis.call('SET', KEYS[4], string.format('%.0f', tocc + w), 'PX', ttl)
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[3], ttl)
  return {1, n, w, occ + w, tocc + w}
end
local w = unit * least
local best, scope, scope_occ = -1, '', 0
local checks = {{KEYS[1], occ, lane_limit, 'global'}, {KEYS[3], tocc, tenant_limit, 'tenant'}}
for _, c in ipairs(checks) do
  if c[2] + w > c[3] then
    local ts = leaves_at(c[1], c[2] + w - c[3])
    local retry = window
    if ts ~= nil then retry = ts + window - now end
    if retry > best then best, scope, scope_occ = retry, c[4], c[2] end
  end
end
return {0, w, scope_occ, best, scope}
"""


# KEYS as above. ARGV: 1 member "<weight>:<lane>:<id>", 2 weight to refund.
# The member is replaced by one with the weight left (removed when none is), same score.
_REFUND_LUA = r"""
local refund = tonumber(ARGV[2])
local weight = tonumber(string.match(ARGV[1], '^(%d+):'))
local rest = string.match(ARGV[1], '^%d+(:.*)$')
local left = weight - refund
for i = 1, 3, 2 do
  local score = redis.call('ZSCORE', KEYS[i], ARGV[1])
  if score then
    redis.call('ZREM', KEYS[i], ARGV[1])
    if left > 0 then redis.call('ZADD', KEYS[i], score, string.format('%.0f', left) .. rest) end
    if redis.call('EXISTS', KEYS[i + 1]) == 1 then redis.call('DECRBY', KEYS[i + 1], refund) end
  end
end
return left
"""

# KEYS as above. ARGV: 1 ":<id>". Removes whatever an admit script call that timed out on our
# side recorded under that id (the request was decided by the local fallback instead).
_RECONCILE_LUA = r"""
local removed = 0
for i = 1, 3, 2 do
  local cursor = '0'
  repeat
    local page = redis.call('ZSCAN', KEYS[i], cursor, 'MATCH', '*' .. ARGV[1])
    cursor = page[1]
    for j = 1, #page[2], 2 do
      local member = page[2][j]
      redis.call('ZREM', KEYS[i], member)
      if redis.call('EXISTS', KEYS[i + 1]) == 1 then
        redis.call('DECRBY', KEYS[i + 1], tonumber(string.match(member, '^(%d+):')))
      end
      if i == 1 then removed = removed + 1 end
    end
  until cursor == '0'
end
return removed
"""


class _RedisDown(Exception):
    pass


def _redis_errors() -> tuple[type[BaseException], ...]:
    try:
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - redis is installed wherever this class is used
        return (OSError, TimeoutError)
    return (RedisError, OSError, TimeoutError)


class RedisWeightWindow:
    """The same admission as WeightWindow, enforced across gateway replicas through one Redis.

    Methods are coroutines (admit, plan, occupancy); fits_ever/max_weight are plain. Keys live under
    ``{prefix}`` (a hash tag, so a Redis Cluster keeps them in one slot). Time is Redis TIME unless a
    `clock` is given (tests).

    Each request is decided atomically in Redis: its precheck hold is released only once Redis
    has decided (so a burst arriving meanwhile still sees it), and the weight in flight is this
    replica's own (`fallback.capacity`: each replica learns what inference delivers to it).

    When Redis fails or times out (`op_timeout`), the call is decided by `outage`, a local window
    holding `budget / replicas` (this replica's share; it also mirrors what Redis admitted here),
    the Admission says ``source="local_fallback"``, `on_fallback(exc)` is called once per outage
    and Redis is tried again after `retry_interval` seconds. A script call that timed out on our
    side may still have run in Redis: its id is remembered and whatever it recorded is removed
    once Redis answers again, so no request is admitted twice. `fallback` (full budget) mirrors
    this replica's admissions for the precheck.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        redis: Any,
        *,
        prefix: str = "llmesh:admission",
        clock: Callable[[], float] | None = None,
        fallback: WeightWindow | None = None,
        op_timeout: float = 0.25,
        retry_interval: float = 1.0,
        on_fallback: Callable[[BaseException], None] | None = None,
        replicas: int = 1,
    ) -> None:
        self.config = config
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._local_clock = clock or time.monotonic
        self.fallback = fallback or WeightWindow(config, clock=self._local_clock)
        self.fallback.source = SOURCE_FALLBACK
        share = dataclasses.replace(
            config,
            budget=config.budget / replicas,
            tenant_budgets={k: v / replicas for k, v in config.tenant_budgets.items()},
            adaptive=False,
        )
        self.outage = WeightWindow(share, clock=self._local_clock)
        self.outage.source = SOURCE_FALLBACK
        self.op_timeout = op_timeout
        self.retry_interval = retry_interval
        self.on_fallback = on_fallback
        self.fallbacks = 0  # calls served by the local fallback
        self.reconciled = 0  # records removed from Redis after a timed-out call
        self.redis_ok = True
        self._retry_at = 0.0
        self._scripts: dict[str, Any] = {}
        self._unreconciled: list[tuple[str, str]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._errors: tuple[type[BaseException], ...] = (*_redis_errors(), _RedisDown)

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(self.config.lanes)

    def fits_ever(self, weight: int, tenant: str | None = None, lane: str = INTERACTIVE) -> bool:
        return weight <= self.config.max_weight(tenant, lane)

    def max_weight(self, tenant: str | None = None, lane: str = INTERACTIVE) -> float:
        return self.config.max_weight(tenant, lane)

    def capacity(self, model: str = "") -> CapacityLimit:
        return self.fallback.capacity(model)

    async def admit(self, tenant: str, weight: int, lane: str = INTERACTIVE) -> Admission:
        req = _request(self.config, tenant, weight, 1, lane, False, planned=False)

        def local() -> Admission:
            admission = self.outage.admit(tenant, weight, lane)
            self.fallback.record(tenant, admission.weight, lane)
            return admission

        return await self._take(req, local)

    async def plan(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        allow_degrade: bool | None = None,
        hold: Hold | None = None,
        model: str = "",
    ) -> Admission:
        degrade = self.config.degrade if allow_degrade is None else allow_degrade
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = _request(self.config, tenant, unit, want, lane, degrade, planned=True)
        try:
            # The weight in flight is this replica's: cap (or refuse) before asking Redis.
            own = hold.weight if hold is not None and not hold.released else 0
            fits, retry = self.fallback.flight_room(req, model, with_holds=True, own_hold=own)
            if fits < req.least:
                capacity = self.capacity(model)
                raise _refusal(self.config, req, "in_flight", capacity.in_flight, retry, capacity.limit())
            req = dataclasses.replace(req, want=fits)

            def local() -> Admission:
                admission = self.outage.plan(tenant, unit, req.want, lane, degrade)
                entry = self.fallback.record(tenant, admission.weight, lane)
                ticket = self.fallback.ticket(tenant, model, unit, admission.weight, entry)
                return dataclasses.replace(admission, ticket=ticket, degraded=admission.max_new_tokens != want)

            admission = await self._take(req, local, model=model)
            if admission.max_new_tokens is not None and admission.max_new_tokens < want:
                admission = dataclasses.replace(admission, degraded=True)
            return admission
        finally:
            if hold is not None:
                hold.release()  # only now: a burst arriving while Redis decided still saw it

    def precheck(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        hold: bool = False,
        model: str = "",
    ) -> Hold | None:
        """Like WeightWindow.precheck, against this replica's own recent admissions (mirrored
        locally) and its own holds: a lower bound of the shared occupancy."""
        return self.fallback.precheck(tenant, input_tokens, max_new_tokens, lane, hold, model)

    async def occupancy(self, tenant: str | None = None) -> float:
        try:
            occ, tocc = await self._eval(_LUA, tenant or "", "peek")
        except self._errors as exc:
            self._down(exc)
            return self.fallback.occupancy(tenant)
        return float(tocc if tenant is not None else occ)

    def _keys(self, tenant: str) -> list[str]:
        base = "{" + self.prefix + "}"
        return [f"{base}:all", f"{base}:sum", f"{base}:tz:{tenant}", f"{base}:ts:{tenant}"]

    async def _run(self, source: str, keys: list[str], args: list[Any], timeout: float) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.redis.register_script(source)
        async with asyncio.timeout(timeout):
            return await script(keys=keys, args=args)

    async def _eval(self, source: str, tenant: str, mode: str, *args: Any) -> list[Any]:
        if not self.redis_ok and self._local_clock() < self._retry_at:
            raise _RedisDown("redis marked down")
        now = "" if self.clock is None else str(round(self.clock() * 1_000_000))
        window_us = str(round(self.config.window_seconds * 1_000_000))
        result = await self._run(source, self._keys(tenant), [now, window_us, mode, *args], self.op_timeout)
        if not self.redis_ok:
            self.redis_ok = True
            log.info("admission: redis reachable again, cluster-wide budget restored")
        if self._unreconciled:
            self._spawn(self._reconcile())
        return list(result)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile(self) -> None:
        pending, self._unreconciled = self._unreconciled, []
        for i, (tenant, request_id) in enumerate(pending):
            try:
                self.reconciled += int(
                    await self._run(_RECONCILE_LUA, self._keys(tenant), [f":{request_id}"], self.op_timeout * 4)
                )
            except self._errors as exc:
                log.warning("admission: reconciling timed-out admissions failed (%r); will retry", exc)
                self._unreconciled.extend(pending[i:])
                return

    async def _refund(self, tenant: str, member: str, weight: int) -> None:
        try:
            await self._run(_REFUND_LUA, self._keys(tenant), [member, weight], self.op_timeout * 4)
        except self._errors as exc:
            log.debug("admission: refund not recorded in redis (%r); it ages out with the window", exc)

    async def settle(self) -> None:
        """Waits for refunds and reconciliations in progress (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _down(self, exc: BaseException) -> None:
        self.fallbacks += 1
        self._retry_at = self._local_clock() + self.retry_interval
        if self.redis_ok and not isinstance(exc, _RedisDown):
            self.redis_ok = False
            log.warning("admission: redis unavailable (%r); enforcing this replica's share locally", exc)
            if self.on_fallback is not None:
                try:
                    self.on_fallback(exc)
                except Exception:
                    log.exception("admission: on_fallback callback failed")

    async def _take(self, req: _Request, local: Callable[[], Admission], model: str = "") -> Admission:
        config = self.config
        lane_limit, tenant_limit = config.lane_limit(req.lane), config.tenant_limit(req.tenant)
        request_id = uuid.uuid4().hex
        try:
            result = await self._eval(
                _LUA,
                req.tenant,
                "admit",
                req.unit,
                req.want,
                req.least,
                _num(lane_limit),
                _num(tenant_limit),
                req.lane,
                request_id,
            )
        except self._errors as exc:
            if not isinstance(exc, _RedisDown):
                # The script may have run before our timeout: undo it once Redis answers again.
                self._unreconciled.append((req.tenant, request_id))
            self._down(exc)
            return local()
        if int(result[0]) == 1:
            n, weight, occ, tocc = (int(v) for v in result[1:5])
            entry = self.fallback.record(req.tenant, weight, req.lane)
            self.outage.record(req.tenant, weight, req.lane)
            ticket = None
            if req.planned:
                ticket = self.fallback.ticket(req.tenant, model, req.unit, weight, entry)
                member = f"{weight}:{req.lane}:{request_id}"
                tenant = req.tenant
                ticket.on_refund = lambda refund: self._spawn(self._refund(tenant, member, refund))
            return Admission(
                tenant=req.tenant,
                lane=req.lane,
                weight=weight,
                occupancy=occ,
                budget=config.budget,
                tenant_occupancy=tocc,
                tenant_budget=tenant_limit,
                max_new_tokens=n if req.planned else None,
                degraded=n < req.want,
                source=SOURCE_REDIS,
                ticket=ticket,
            )
        _, _, scope_occ, retry_us, scope = result
        scope = scope.decode() if isinstance(scope, bytes) else str(scope)
        raise _refusal(config, req, scope, int(scope_occ), int(retry_us) / 1_000_000)


def connect_redis(url: str, socket_timeout: float = 0.25) -> Any:
    """A redis.asyncio client for RedisWeightWindow (redis is imported only when used; connects lazily)."""
    from redis.asyncio import Redis

    return Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)


__all__ = [
    "BATCH",
    "DEFAULT_LANES",
    "INTERACTIVE",
    "REASON_BUDGET",
    "REASON_TENANT",
    "REASON_TOO_HEAVY",
    "Admission",
    "AdmissionConfig",
    "RedisWeightWindow",
    "RequestTooHeavy",
    "WeightWindow",
    "connect_redis",
    "parse_budget",
    "parse_lane_shares",
    "parse_share",
    "parse_tenant_budgets",
    "request_weight",
]
