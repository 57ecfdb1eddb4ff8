"""A model's replicas and the choice among them (gateway domain logic, no gRPC here).

Each model is served by a set of replicas (several targets in LLMESH_MODELS, or the addresses a
headless Service's DNS name resolves to), each with its own channel, health, load and outlier
state; `services/gateway/routing.py` holds the gRPC side. This module decides:

Pick
    The replica that can start the request soonest: its predicted wait from what this gateway
    has in flight there (each request's tokens still to come, whether it started) and what the
    replica last reported (its rows, its step time, the requests other gateways sent), rows
    freeing as the running requests end. Ties go to the emptier replica. When some replica's
    report is stale (older than `report_stale_seconds`), the power of two choices on the same
    score: two random healthy replicas, the better of the two. `pick="round_robin"` ignores load
    (the comparison arm of `bench.replicas`).
Prefix affinity
    A request whose prompt's leading blocks (`llmesh.prefix_hash`: system prompt, earlier turns,
    retrieved context) a replica holds (its reported prefix hashes, and what this gateway sent
    there lately) goes to the one holding the longest prefix of at least `affinity_min_tokens`,
    unless that replica's load (requests in flight there, plus one) is above
    ceil(`affinity_load_factor` x the mean over the healthy replicas, this request included)
    (bounded-load consistent hashing): then the pick above decides among the others. Several
    gateways agree because the engines' own hashes lead.
Outlier ejection (Envoy's outlier detection)
    A replica is ejected after `eject_consecutive_failures` failures in a row, after
    `eject_health_failures` failed health checks in a row, or when it is stalled: nothing heard
    from it (no load report, no stream message, no health answer) for `stall_seconds` while
    something was expected. Its requests that have no first token yet are cancelled (and retried
    elsewhere by the caller); those past it fail at once rather than hang. It stays out for
    `eject_base_seconds` x 2^(ejections-1) (at most `eject_max_seconds`; the count starts over
    after `eject_max_seconds` in service), and returns once that is over and its health check
    passes. Never more than `max_ejected_share` of the replicas are out at once (at least one of
    two or more may be); the only replica of a model is never ejected (its breaker decides).
Retry budget
    A retry (before the first token, on another replica) spends one token; every first attempt
    earns `retry_budget_ratio` of one, up to `retry_budget_burst`: retries stay within that
    share of the load, whatever fails. The requests an ejection cuts before their first token
    move to another replica without spending it (the ejected replica will not do that work).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from llmesh.retry_budget import RetryBudget
from llmesh.settings import RoutingSettings
from services.gateway.load_report import ReplicaReport

PICK_LEAST_WAIT = "least_wait"
PICK_ROUND_ROBIN = "round_robin"
PICKS = (PICK_LEAST_WAIT, PICK_ROUND_ROBIN)

# Affinity outcomes (metric labels).
AFFINITY_HIT = "hit"  # went to the replica holding the longest prefix
AFFINITY_OVERLOADED = "overloaded"  # that replica was loaded above the bound: went elsewhere
AFFINITY_MISS = "miss"  # another replica held a longer prefix (round robin, or it was out)
AFFINITY_NONE = "none"  # no replica held enough of the prompt

# Ejection reasons (metric labels).
EJECT_FAILURES = "failures"
EJECT_HEALTH = "health"
EJECT_STALLED = "stalled"

#: Seconds per generated token assumed before a replica reported a step time.
DEFAULT_STEP_S = 0.05
#: Tokens of an answer assumed for a request another gateway sent (its budget is not known here).
DEFAULT_FOREIGN_TOKENS = 64
#: Prefix hashes remembered per replica as sent from here (the newest kept).
SENT_HASHES = 50_000
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class RoutingConfig:
    pick: str = PICK_LEAST_WAIT
    report_stale_seconds: float = 2.0
    eject_consecutive_failures: int = 3
    eject_health_failures: int = 2
    stall_seconds: float = 0.75
    eject_base_seconds: float = 1.0
    eject_max_seconds: float = 30.0
    max_ejected_share: float = 0.5
    health_interval_seconds: float = 0.25
    health_timeout_seconds: float = 0.5
    first_token_timeout_seconds: float = 10.0
    retry_budget_ratio: float = 0.1
    retry_budget_burst: float = 10.0
    affinity: bool = True
    affinity_min_tokens: int = 32
    affinity_load_factor: float = 1.25
    dns_refresh_seconds: float = 5.0

    @classmethod
    def from_settings(cls, s: RoutingSettings) -> RoutingConfig:
        """From the gateway's LLMESH_ROUTING_* settings."""
        return cls(
            pick=s.pick,
            eject_consecutive_failures=s.eject_failures,
            stall_seconds=s.stall_seconds,
            eject_base_seconds=s.eject_seconds,
            max_ejected_share=s.max_ejected_share,
            health_interval_seconds=s.health_seconds,
            health_timeout_seconds=max(0.5, s.health_seconds * 2),
            first_token_timeout_seconds=s.first_token_seconds,
            retry_budget_ratio=s.retry_budget,
            affinity=s.affinity_min_tokens > 0,
            affinity_min_tokens=s.affinity_min_tokens,
            affinity_load_factor=max(1.0, s.affinity_load_factor),
            dns_refresh_seconds=s.dns_seconds,
        )

    def __post_init__(self) -> None:
        if self.pick not in PICKS:
            raise ValueError(f"pick must be one of {', '.join(PICKS)}")
        if not 0 <= self.max_ejected_share <= 1:
            raise ValueError("max_ejected_share must be in [0, 1]")
        if self.affinity_load_factor < 1:
            raise ValueError("affinity_load_factor must be >= 1")
        for name in ("stall_seconds", "eject_base_seconds", "health_interval_seconds", "health_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(eq=False)
class Flight:
    """One request in flight on a replica."""

    replica: Replica
    max_new_tokens: int
    started_at: float
    cancel: Callable[[bool], None] | None = None  # called with True before the first token
    generated: int = 0
    first_token: bool = False

    def remaining(self) -> int:
        return max(1, self.max_new_tokens - self.generated)


@dataclass(eq=False)
class Replica:
    address: str
    flights: list[Flight] = field(default_factory=list)
    load: ReplicaReport | None = None  # what it last reported
    load_at: float = -math.inf
    own_at_report: int = 0  # flights of this gateway when the report came
    seconds_per_token: float | None = None  # as this gateway saw its streams
    # Outlier state.
    consecutive_failures: int = 0
    health_failures: int = 0
    health_ok: bool | None = None  # None: no health check answered yet (or none served)
    heartbeat: bool = False  # something reports regularly (a load stream, health checks)
    last_heard: float = -math.inf
    ejected_until: float | None = None
    ejected_at: float = -math.inf
    ejections: int = 0
    returned_at: float = -math.inf
    sent: OrderedDict[int, None] = field(default_factory=OrderedDict)

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def step(self) -> float:
        reported = self.load.step_seconds if self.load is not None else None
        return max(reported or 0.0, self.seconds_per_token or 0.0) or DEFAULT_STEP_S

    def fresh(self, now: float, stale: float) -> bool:
        return self.load is not None and now - self.load_at <= stale

    def foreign(self, now: float, stale: float) -> int:
        """Requests there that others sent (as of its report)."""
        if not self.fresh(now, stale) or self.load is None:
            return 0
        return max(0, self.load.running + self.load.waiting - self.own_at_report)

    def occupancy(self, now: float, stale: float) -> int:
        return len(self.flights) + self.foreign(now, stale)

    def predicted_wait(self, now: float, stale: float) -> float:
        """Seconds until a new request would get a row here: 0 while rows are free; else rows
        free as the running requests end (the ones with a first token first, then the oldest
        queued), each queued one taking a row in turn."""
        rows = self.load.max_running if self.fresh(now, stale) and self.load is not None else 0
        remaining = [f.remaining() for f in self.flights if f.first_token]
        queued = [f.remaining() for f in self.flights if not f.first_token]
        remaining += [DEFAULT_FOREIGN_TOKENS] * self.foreign(now, stale)
        if not rows:
            return (len(remaining) + len(queued)) * self.step()  # rows unknown: occupancy stands in
        if len(remaining) + len(queued) < rows:
            return 0.0
        remaining.sort()
        running, ahead = remaining[:rows], remaining[rows:] + queued
        running += [0] * (rows - len(running))
        heapq.heapify(running)
        for tokens in ahead:
            heapq.heappush(running, heapq.heappop(running) + tokens)
        return running[0] * self.step()

    def holds(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt this replica holds."""
        cached = self.load.prefix_hashes if self.load is not None else frozenset()
        n = 0
        for h in hashes:
            if h not in cached and h not in self.sent:
                break
            n += 1
        return n

    def remember(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.sent[h] = None
            self.sent.move_to_end(h)
        while len(self.sent) > SENT_HASHES:
            self.sent.popitem(last=False)


@dataclass(frozen=True)
class Choice:
    replica: Replica
    affinity: str  # one of the AFFINITY_* outcomes
    matched_tokens: int = 0


class ReplicaSet:
    """The replicas of one model and the routing decisions over them (one owner: the router)."""

    def __init__(
        self,
        model: str,
        config: RoutingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_eject: Callable[[Replica, str], None] | None = None,
        on_return: Callable[[Replica], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config or RoutingConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        self.replicas: dict[str, Replica] = {}
        self.budget = RetryBudget(self.config.retry_budget_ratio, self.config.retry_budget_burst)
        self.on_eject = on_eject
        self.on_return = on_return
        self._next = 0
        self._last_tick = math.inf  # before the first periodic tick: no lag to judge
        self._lag_until = -math.inf

    # --- membership ---------------------------------------------------------------------------
    def set_addresses(self, addresses: Iterable[str]) -> tuple[list[Replica], list[Replica]]:
        """The replicas are now these addresses: returns (added, removed)."""
        wanted = list(dict.fromkeys(addresses))
        removed = [r for a, r in self.replicas.items() if a not in wanted]
        for r in removed:
            del self.replicas[r.address]
            for flight in list(r.flights):  # gone from DNS: what has not started goes elsewhere
                if not flight.first_token and flight.cancel is not None:
                    flight.cancel(True)
        added = [Replica(a) for a in wanted if a not in self.replicas]
        for r in added:
            self.replicas[r.address] = r
        return added, removed

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if not r.ejected]

    def capacity(self) -> int:
        """Rows of the healthy replicas that reported them (what admission may count on)."""
        now = self.clock()
        return sum(
            r.load.max_running
            for r in self.healthy()
            if r.load is not None and r.fresh(now, self.config.report_stale_seconds)
        )

    # --- the pick -----------------------------------------------------------------------------
    def pick(self, hashes: Sequence[int] = (), exclude: Iterable[Replica] = ()) -> Choice | None:
        """The replica for a request (`hashes`: its prompt's prefix block hashes); None when no
        healthy replica is left outside `exclude` (a retry), or none is known."""
        excluded = set(map(id, exclude))
        candidates = [r for r in self.healthy() if id(r) not in excluded]
        if not candidates:
            if excluded or not self.replicas:
                return None  # a retry goes to a healthy replica or nowhere
            # Every replica is out (the share cap keeps this rare): the one ejected longest ago.
            candidates = [min(self.replicas.values(), key=lambda r: r.ejected_at)]
        now = self.clock()
        stale = self.config.report_stale_seconds
        holder, matched = None, 0
        if hashes:
            for r in candidates:
                n = r.holds(hashes)
                if n > matched:
                    holder, matched = r, n
        block = self._block_tokens(candidates)
        matched_tokens = matched * block
        if self.config.pick == PICK_ROUND_ROBIN:
            if not excluded:  # a retry takes the next one without moving the turn on
                self._next += 1
            chosen = candidates[self._next % len(candidates)]
            outcome = self._outcome(holder, chosen, matched_tokens)
            return Choice(chosen, outcome, matched_tokens)
        if holder is not None and self.config.affinity and matched_tokens >= self.config.affinity_min_tokens:
            # Bounded-load consistent hashing: no replica above ceil(c x the mean with this one).
            total = sum(r.occupancy(now, stale) for r in candidates) + 1
            bound = math.ceil(self.config.affinity_load_factor * total / len(candidates))
            if holder.occupancy(now, stale) + 1 <= bound:
                return Choice(holder, AFFINITY_HIT, matched_tokens)
            others = [r for r in candidates if r is not holder] or candidates
            return Choice(self._least_wait(others, now), AFFINITY_OVERLOADED, matched_tokens)
        chosen = self._least_wait(candidates, now)
        return Choice(chosen, self._outcome(holder, chosen, matched_tokens), matched_tokens)

    def _outcome(self, holder: Replica | None, chosen: Replica, matched_tokens: int) -> str:
        if holder is None or matched_tokens < self.config.affinity_min_tokens:
            return AFFINITY_NONE
        return AFFINITY_HIT if holder is chosen else AFFINITY_MISS

    def _block_tokens(self, replicas: Sequence[Replica]) -> int:
        for r in replicas:
            if r.load is not None and r.load.block_tokens:
                return r.load.block_tokens
        return DEFAULT_BLOCK_TOKENS

    def block_tokens(self) -> int:
        return self._block_tokens(list(self.replicas.values()))

    def _least_wait(self, candidates: Sequence[Replica], now: float) -> Replica:
        stale = self.config.report_stale_seconds

        def score(r: Replica) -> tuple[float, float]:
            rows = r.load.max_running if r.load is not None and r.fresh(now, stale) else 0
            return r.predicted_wait(now, stale), r.occupancy(now, stale) / max(1, rows or 1)

        if len(candidates) > 2 and not all(r.fresh(now, stale) for r in candidates):
            candidates = self.rng.sample(list(candidates), 2)  # stale signals: power of two choices
        best = min(score(r) for r in candidates)
        tied = [r for r in candidates if score(r) == best]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    # --- a request's life ---------------------------------------------------------------------
    def start(
        self,
        choice: Choice,
        max_new_tokens: int,
        hashes: Sequence[int] = (),
        cancel: Callable[[bool], None] | None = None,
    ) -> Flight:
        r = choice.replica
        flight = Flight(r, max_new_tokens, self.clock(), cancel)
        r.flights.append(flight)
        if hashes:
            r.remember(hashes)
        return flight

    def progress(self, flight: Flight, tokens: int) -> None:
        now = self.clock()
        r = flight.replica
        r.last_heard = now
        if not flight.first_token:
            flight.first_token = True
        flight.generated += tokens

    def finish(self, flight: Flight, failed: bool | None) -> None:
        """The request ended: `failed` True (the replica failed it), False (it answered), None
        (no verdict: the caller's deadline or cancellation)."""
        r = flight.replica
        if flight in r.flights:
            r.flights.remove(flight)
        now = self.clock()
        if failed is None:
            return
        if not failed:
            r.consecutive_failures = 0
            r.last_heard = now
            if flight.generated > 1 and flight.first_token:
                pace = (now - flight.started_at) / flight.generated
                r.seconds_per_token = pace if r.seconds_per_token is None else 0.9 * r.seconds_per_token + 0.1 * pace
            return
        r.consecutive_failures += 1
        if r.consecutive_failures >= self.config.eject_consecutive_failures:
            self.eject(r, EJECT_FAILURES)

    # --- signals ------------------------------------------------------------------------------
    def reported(self, replica: Replica, load: ReplicaReport) -> None:
        now = self.clock()
        replica.load = load
        replica.load_at = now
        replica.own_at_report = len(replica.flights)
        replica.last_heard = now
        replica.heartbeat = True

    def unreported(self, replica: Replica) -> None:
        """Its load stream ended (or it reports none)."""
        replica.load = None
        replica.load_at = -math.inf

    def health(self, replica: Replica, ok: bool | None) -> None:
        """A health check's verdict (None: the replica serves no health service)."""
        now = self.clock()
        if ok is None:
            replica.health_ok = None
            return
        replica.heartbeat = True
        replica.health_ok = ok
        if ok:
            replica.health_failures = 0
            replica.last_heard = now
            self.tick()
            return
        replica.health_failures += 1
        if replica.health_failures >= self.config.eject_health_failures:
            self.eject(replica, EJECT_HEALTH)

    def tick(self, periodic: bool = False) -> None:
        """Stalled replicas out; ejected ones whose time is over and that pass their health
        check back. `periodic`: the router's regular tick; one that comes late (this process was
        not running: its event loop lagged) holds the stall judgement for a stall period, since
        the silence was this side's."""
        now = self.clock()
        if periodic:
            if now - self._last_tick > self.config.stall_seconds / 2:
                self._lag_until = now + self.config.stall_seconds
            self._last_tick = now
        for r in list(self.replicas.values()):
            if r.ejected:
                assert r.ejected_until is not None
                answering = r.health_ok is not False and r.last_heard >= r.ejected_at
                if now >= r.ejected_until and (answering or not r.heartbeat):
                    self._return(r, now)
            elif r.heartbeat and now - r.last_heard > self.config.stall_seconds and now >= self._lag_until:
                self.eject(r, EJECT_STALLED)

    def eject(self, replica: Replica, reason: str) -> bool:
        if replica.ejected:
            return False
        total = len(self.replicas)
        most = 0 if total < 2 else max(1, math.floor(total * self.config.max_ejected_share))
        if sum(r.ejected for r in self.replicas.values()) >= most:
            return False
        now = self.clock()
        if now - max(replica.returned_at, replica.ejected_at) > self.config.eject_max_seconds:
            replica.ejections = 0  # long in service: the backoff starts over
        replica.ejections += 1
        backoff = min(self.config.eject_max_seconds, self.config.eject_base_seconds * 2 ** (replica.ejections - 1))
        replica.ejected_at = now
        replica.ejected_until = now + backoff
        replica.consecutive_failures = 0
        if self.on_eject is not None:
            self.on_eject(replica, reason)
        for flight in list(replica.flights):
            if flight.cancel is not None:
                flight.cancel(not flight.first_token)
        return True

    def _return(self, replica: Replica, now: float) -> None:
        replica.ejected_until = None
        replica.returned_at = now
        replica.health_failures = 0
        if self.on_return is not None:
            self.on_return(replica)
