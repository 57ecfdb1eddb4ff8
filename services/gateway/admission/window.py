"""The in-process sliding window (sync, lock-protected), with the weight in flight bounded per
model by the learned `CapacityLimit` where admission falls back to it."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from services.gateway.admission.capacity import CapacityLimit
from services.gateway.admission.config import (
    INTERACTIVE,
    SOURCE_LOCAL,
    Admission,
    AdmissionConfig,
    WeightRequest,
    weight_request,
    window_refusal,
)
from services.gateway.admission.reservations import Hold, Ticket


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


def _promised(req: WeightRequest, held: int) -> int:
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
        return self._take(weight_request(self.config, tenant, weight, 1, lane, False, planned=False))

    def plan(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        allow_degrade: bool | None = None,
        hold: Hold | None = None,
        model: str = "",
        in_flight_limit: bool = True,
    ) -> Admission:
        """Admits the request, capping max_new_tokens (not below min_new_tokens) when the full weight
        does not fit and degrading is allowed (default: config.degrade); else raises. `hold` is the
        request's own reservation from `precheck`: it is released, and the others' are counted.
        The admission carries a Ticket: report progress on it and finish it on every exit path."""
        degrade = self.config.degrade if allow_degrade is None else allow_degrade
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = weight_request(self.config, tenant, unit, want, lane, degrade, planned=True)
        if hold is None:
            return self._take(req, model=model, in_flight_limit=in_flight_limit)
        # The request's own reservation turns into its admission; the reservations of requests
        # still on their way are counted, so this one cannot take the room they were promised.
        # What it held is its own whatever changed meanwhile (the learned limit may have shrunk):
        # a request that passed the precheck is not refused after its hops for that.
        promised = 0 if hold.released else hold.weight
        hold.release()
        return self._take(req, with_holds=True, model=model, promised=promised, in_flight_limit=in_flight_limit)

    def precheck(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        hold: bool = False,
        model: str = "",
        in_flight_limit: bool = True,
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
        req = weight_request(self.config, tenant, unit, want, lane, self.config.degrade, planned=True)
        fits = self._take(req, record=False, with_holds=True, model=model, in_flight_limit=in_flight_limit)
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

    def release_hold(self, hold: Hold) -> None:
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

    def ticket_progressed(self, ticket: Ticket, weight: int) -> None:
        with self._lock:
            capacity = self.capacity(ticket.model)
            capacity.in_flight -= weight
            now = self.clock()
            if not ticket.streaming:
                # Its first tokens: the time until now was its queue and prefill, not a stall.
                capacity.advance(now)
                ticket.streaming = True
                ticket.first_at = now
                ticket.first_tokens = ticket.used // max(1, ticket.unit)
                capacity.streaming += 1
                capacity.first_token(now, now - ticket.admitted_at)
            elif weight > 0:
                capacity.between_tokens((now - ticket.last_at) * ticket.unit / weight)
            ticket.last_at = now
            capacity.advance(now, weight)

    def ticket_finished(self, ticket: Ticket, refund: int) -> None:
        with self._lock:
            capacity = self.capacity(ticket.model)
            capacity.advance(self.clock())
            capacity.in_flight -= refund
            capacity.requests -= 1
            if ticket.streaming:
                capacity.streaming -= 1
        if refund:
            self.refund(ticket.tenant, ticket.entry, refund)

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

    def flight_room(self, req: WeightRequest, model: str, with_holds: bool, own_hold: int = 0) -> tuple[int, float]:
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
        self,
        req: WeightRequest,
        record: bool = True,
        with_holds: bool = False,
        model: str = "",
        promised: int = 0,
        in_flight_limit: bool = True,
    ) -> Admission:
        """`promised`: weight this request held since its precheck (already released): room for at
        least that much is its own. `in_flight_limit` False: the learned limit is not applied (the
        engine's own load decides, see AdmissionController); the weight in flight is still kept."""
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
            flight = max(capacity.room(with_holds), _promised(req, promised)) if in_flight_limit else math.inf
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
        raise window_refusal(config, req, worst[1], worst[2], worst[0], capacity.limit())
