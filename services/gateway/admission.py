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

``WeightWindow`` is the in-process window (sync, no awaits). ``RedisWeightWindow`` has the same
methods as coroutines and enforces one budget across gateway replicas with a Redis sorted set and
an atomic Lua script; when Redis is unreachable it falls back to its local ``WeightWindow``.
"""

from __future__ import annotations

import asyncio
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


class Hold:
    """The predicted weight of a request that passed `precheck` and is on its way to `plan`
    (retrieval, tokenizer). Later prechecks and plans count it, so a burst that arrives together
    is shed at once instead of each request paying for its hops before finding the window full."""

    __slots__ = ("_window", "released", "tenant", "weight")

    def __init__(self, window: WeightWindow, tenant: str, weight: int) -> None:
        self._window = window
        self.tenant = tenant
        self.weight = weight
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
    config: AdmissionConfig, req: _Request, scope: str, occupancy: float, retry_after: float
) -> ResourceExhausted:
    weight = req.unit * req.least
    limit = config.tenant_limit(req.tenant) if scope == "tenant" else config.lane_limit(req.lane)
    reason = REASON_TENANT if scope == "tenant" else REASON_BUDGET
    what = f"tenant {req.tenant!r}" if scope == "tenant" else f"lane {req.lane!r}"
    return ResourceExhausted(
        f"{what}: weight {weight} + {_num(occupancy)} admitted in the last {config.window_seconds:g}s or on its way "
        f"exceeds {_num(limit)}; retry in {retry_after:.3f}s",
        retry_after=retry_after,
        reason=reason,
        metadata={
            "weight": str(weight),
            "occupancy": _num(occupancy),
            "budget": _num(limit),
            "scope": scope,
            "tenant": req.tenant,
            "lane": req.lane,
        },
    )


# --- in-process window ---------------------------------------------------------------------------


class _Series:
    """Entries (timestamp, weight) in time order with their running sum."""

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def trim(self, cutoff: float) -> None:
        entries = self.entries
        while entries and entries[0][0] <= cutoff:
            self.total -= entries.popleft()[1]

    def add(self, ts: float, weight: int) -> None:
        self.entries.append((ts, weight))
        self.total += weight

    def leaves_at(self, need: float) -> float | None:
        """Timestamp of the entry whose departure frees `need` weight (oldest first)."""
        freed = 0
        for ts, weight in self.entries:
            freed += weight
            if freed >= need:
                return ts
        return None


class WeightWindow:
    """Sliding-window weight admission in one process. Sync and lock-protected (no awaits)."""

    def __init__(self, config: AdmissionConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._all = _Series()
        self._tenants: dict[str, _Series] = {}
        self._held = 0
        self._held_by_tenant: dict[str, int] = {}
        self._lock = threading.Lock()
        self.source = SOURCE_LOCAL

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(self.config.lanes)

    def fits_ever(self, weight: int, tenant: str | None = None, lane: str = INTERACTIVE) -> bool:
        return weight <= self.config.max_weight(tenant, lane)

    def max_weight(self, tenant: str | None = None, lane: str = INTERACTIVE) -> float:
        return self.config.max_weight(tenant, lane)

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
    ) -> Admission:
        """Admits the request, capping max_new_tokens (not below min_new_tokens) when the full weight
        does not fit and degrading is allowed (default: config.degrade); else raises. `hold` is the
        request's own reservation from `precheck`: it is released, and the others' are counted."""
        degrade = self.config.degrade if allow_degrade is None else allow_degrade
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = _request(self.config, tenant, unit, want, lane, degrade, planned=True)
        if hold is None:
            return self._take(req)
        # The request's own reservation turns into its admission; the reservations of requests
        # still on their way are counted, so this one cannot take the room they were promised.
        hold.release()
        return self._take(req, with_holds=True)

    def precheck(
        self, tenant: str, input_tokens: int, max_new_tokens: int, lane: str = INTERACTIVE, hold: bool = False
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
        fits = self._take(req, record=False, with_holds=True)
        if not hold:
            return None
        held = Hold(self, tenant, fits.weight)
        with self._lock:
            self._held += held.weight
            self._held_by_tenant[tenant] = self._held_by_tenant.get(tenant, 0) + held.weight
        return held

    def held(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._held if tenant is None else self._held_by_tenant.get(tenant, 0)

    def _unhold(self, hold: Hold) -> None:
        with self._lock:
            self._held -= hold.weight
            left = self._held_by_tenant.get(hold.tenant, 0) - hold.weight
            if left > 0:
                self._held_by_tenant[hold.tenant] = left
            else:
                self._held_by_tenant.pop(hold.tenant, None)

    def record(self, tenant: str, weight: int, lane: str = INTERACTIVE) -> None:
        """Adds weight without checking (mirrors what a cluster window admitted)."""
        with self._lock:
            now = self.clock()
            self._all.add(now, weight)
            self._tenants.setdefault(tenant, _Series()).add(now, weight)

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

    def _take(self, req: _Request, record: bool = True, with_holds: bool = False) -> Admission:
        config = self.config
        lane_limit, tenant_limit = config.lane_limit(req.lane), config.tenant_limit(req.tenant)
        with self._lock:
            now = self.clock()
            cutoff = now - config.window_seconds
            self._all.trim(cutoff)
            series = self._tenant(req.tenant, cutoff) or _Series()
            held = self._held if with_holds else 0
            tenant_held = self._held_by_tenant.get(req.tenant, 0) if with_holds else 0
            room = min(lane_limit - self._all.total - held, tenant_limit - series.total - tenant_held)
            n = req.want if req.unit * req.want <= room else math.floor(room / req.unit)
            if n >= req.least:
                weight = req.unit * n
                if record:
                    self._all.add(now, weight)
                    series.add(now, weight)
                    self._tenants[req.tenant] = series
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
        raise _refusal(config, req, worst[1], worst[2], worst[0])


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
    `clock` is given (tests). When Redis fails or times out (`op_timeout`), the call is served by
    `fallback` (a local WeightWindow that also mirrors what Redis admitted here), the Admission says
    ``source="local_fallback"``, `on_fallback(exc)` is called once per outage and Redis is tried
    again after `retry_interval` seconds. Consider giving the fallback a smaller budget (about
    budget / replicas), since every replica then enforces it on its own.
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
    ) -> None:
        self.config = config
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._local_clock = clock or time.monotonic
        self.fallback = fallback or WeightWindow(config, clock=self._local_clock)
        self.fallback.source = SOURCE_FALLBACK
        self.op_timeout = op_timeout
        self.retry_interval = retry_interval
        self.on_fallback = on_fallback
        self.fallbacks = 0  # calls served by the local fallback
        self.redis_ok = True
        self._retry_at = 0.0
        self._script: Any = None
        self._errors: tuple[type[BaseException], ...] = (*_redis_errors(), _RedisDown)

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(self.config.lanes)

    def fits_ever(self, weight: int, tenant: str | None = None, lane: str = INTERACTIVE) -> bool:
        return weight <= self.config.max_weight(tenant, lane)

    def max_weight(self, tenant: str | None = None, lane: str = INTERACTIVE) -> float:
        return self.config.max_weight(tenant, lane)

    async def admit(self, tenant: str, weight: int, lane: str = INTERACTIVE) -> Admission:
        req = _request(self.config, tenant, weight, 1, lane, False, planned=False)
        return await self._take(req, lambda: self.fallback.admit(tenant, weight, lane))

    async def plan(
        self,
        tenant: str,
        input_tokens: int,
        max_new_tokens: int,
        lane: str = INTERACTIVE,
        allow_degrade: bool | None = None,
        hold: Hold | None = None,
    ) -> Admission:
        degrade = self.config.degrade if allow_degrade is None else allow_degrade
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = _request(self.config, tenant, unit, want, lane, degrade, planned=True)
        if hold is not None:
            hold.release()  # holds are this replica's own: the shared window in Redis has none
        return await self._take(
            req, lambda: self.fallback.plan(tenant, input_tokens, max_new_tokens, lane, degrade, hold)
        )

    def precheck(
        self, tenant: str, input_tokens: int, max_new_tokens: int, lane: str = INTERACTIVE, hold: bool = False
    ) -> Hold | None:
        """Like WeightWindow.precheck, against this replica's own recent admissions (mirrored
        locally) and its own holds: a lower bound of the shared occupancy."""
        return self.fallback.precheck(tenant, input_tokens, max_new_tokens, lane, hold)

    async def occupancy(self, tenant: str | None = None) -> float:
        try:
            occ, tocc = await self._eval(tenant or "", "peek")
        except self._errors as exc:
            self._down(exc)
            return self.fallback.occupancy(tenant)
        return float(tocc if tenant is not None else occ)

    def _keys(self, tenant: str) -> list[str]:
        base = "{" + self.prefix + "}"
        return [f"{base}:all", f"{base}:sum", f"{base}:tz:{tenant}", f"{base}:ts:{tenant}"]

    async def _eval(self, tenant: str, mode: str, *args: Any) -> list[Any]:
        if not self.redis_ok and self._local_clock() < self._retry_at:
            raise _RedisDown("redis marked down")
        if self._script is None:
            self._script = self.redis.register_script(_LUA)
        now = "" if self.clock is None else str(round(self.clock() * 1_000_000))
        window_us = str(round(self.config.window_seconds * 1_000_000))
        async with asyncio.timeout(self.op_timeout):
            result = await self._script(keys=self._keys(tenant), args=[now, window_us, mode, *args])
        if not self.redis_ok:
            self.redis_ok = True
            log.info("admission: redis reachable again, cluster-wide budget restored")
        return list(result)

    def _down(self, exc: BaseException) -> None:
        self.fallbacks += 1
        self._retry_at = self._local_clock() + self.retry_interval
        if self.redis_ok and not isinstance(exc, _RedisDown):
            self.redis_ok = False
            log.warning("admission: redis unavailable (%r); enforcing the budget locally", exc)
            if self.on_fallback is not None:
                try:
                    self.on_fallback(exc)
                except Exception:
                    log.exception("admission: on_fallback callback failed")

    async def _take(self, req: _Request, local: Callable[[], Admission]) -> Admission:
        config = self.config
        lane_limit, tenant_limit = config.lane_limit(req.lane), config.tenant_limit(req.tenant)
        try:
            result = await self._eval(
                req.tenant,
                "admit",
                req.unit,
                req.want,
                req.least,
                _num(lane_limit),
                _num(tenant_limit),
                req.lane,
                uuid.uuid4().hex,
            )
        except self._errors as exc:
            self._down(exc)
            return local()
        if int(result[0]) == 1:
            n, weight, occ, tocc = (int(v) for v in result[1:5])
            self.fallback.record(req.tenant, weight, req.lane)
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
