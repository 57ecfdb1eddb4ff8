"""The sliding window's Redis twin: one budget across gateway replicas, atomic in Lua, with a
local fallback while Redis is away."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from services.gateway.admission.capacity import CapacityLimit
from services.gateway.admission.config import (
    INTERACTIVE,
    SOURCE_FALLBACK,
    SOURCE_REDIS,
    Admission,
    AdmissionConfig,
    WeightRequest,
    weight_request,
    weight_text,
    window_refusal,
)
from services.gateway.admission.reservations import Hold
from services.gateway.admission.window import WeightWindow

log = logging.getLogger("services.gateway.admission")


# KEYS: 1 global zset, 2 global sum, 3 tenant zset, 4 tenant sum
# ARGV: 1 now_us ("" = Redis TIME), 2 window_us, 3 mode (admit|peek), 4 unit, 5 want, 6 least,
#       7 lane limit, 8 tenant limit, 9 lane, 10 unique id
# Members are "<weight>:<lane>:<id>", scored by admission time in microseconds.
# admit -> {1, n, weight, occupancy, tenant_occupancy} or {0, weight, occupancy_of_scope, retry_us, scope}
# peek  -> {occupancy, tenant_occupancy}
ADMIT_LUA = r"""
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
        req = weight_request(self.config, tenant, weight, 1, lane, False, planned=False)

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
        in_flight_limit: bool = True,
    ) -> Admission:
        degrade = self.config.degrade if allow_degrade is None else allow_degrade
        unit, want = max(1, int(input_tokens)), max(1, int(max_new_tokens))
        req = weight_request(self.config, tenant, unit, want, lane, degrade, planned=True)
        try:
            # The weight in flight is this replica's: cap (or refuse) before asking Redis.
            own = hold.weight if hold is not None and not hold.released else 0
            if in_flight_limit:
                fits, retry = self.fallback.flight_room(req, model, with_holds=True, own_hold=own)
                if fits < req.least:
                    capacity = self.capacity(model)
                    raise window_refusal(self.config, req, "in_flight", capacity.in_flight, retry, capacity.limit())
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
        in_flight_limit: bool = True,
    ) -> Hold | None:
        """Like WeightWindow.precheck, against this replica's own recent admissions (mirrored
        locally) and its own holds: a lower bound of the shared occupancy."""
        return self.fallback.precheck(tenant, input_tokens, max_new_tokens, lane, hold, model, in_flight_limit)

    async def occupancy(self, tenant: str | None = None) -> float:
        try:
            occ, tocc = await self._eval(ADMIT_LUA, tenant or "", "peek")
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

    async def _take(self, req: WeightRequest, local: Callable[[], Admission], model: str = "") -> Admission:
        config = self.config
        lane_limit, tenant_limit = config.lane_limit(req.lane), config.tenant_limit(req.tenant)
        request_id = uuid.uuid4().hex
        try:
            result = await self._eval(
                ADMIT_LUA,
                req.tenant,
                "admit",
                req.unit,
                req.want,
                req.least,
                weight_text(lane_limit),
                weight_text(tenant_limit),
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
        raise window_refusal(config, req, scope, int(scope_occ), int(retry_us) / 1_000_000)


def connect_redis(url: str, socket_timeout: float = 0.25) -> Any:
    """A redis.asyncio client for RedisWeightWindow (redis is imported only when used; connects lazily)."""
    from redis.asyncio import Redis

    return Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
