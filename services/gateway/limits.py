"""Per-key limits: requests per minute, tokens per minute and tokens per UTC day (no gRPC here).

Cluster-wide through the shared Redis of the admission window (LLMESH_ADMISSION_REDIS_URL, the
same connection settings; Redis's clock for every replica), with the same shape of window:
per-second buckets over the last 60 s, trimmed and summed by one Lua script per call, all keys
of one API key in one hash slot. Tokens count when a response ends (prompt + completion
generated; a cache hit costs none), so a request is refused once the minute's or the day's
tokens reached the limit, never halfway.

Not a Redis round trip per request: a replica decides a key locally while the key's use, as last
read from Redis plus what this replica added since, stays below its limit by a margin (20 %, and
at least 5); its counts are pushed and the cluster's read back every `sync_seconds`, all keys in
one pipeline. Near a limit every request of that key asks Redis (check and count atomically),
so the limit is exact up to what other replicas admitted locally within one sync interval.

Without Redis (none configured) the limits are this process's. While Redis is unreachable each
replica enforces limit / replicas on its own counts (as the admission window's fallback does),
and asks Redis again after `retry_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmesh import tasks
from llmesh.errors import ResourceExhausted
from services.gateway.auth import KeyLimits

log = logging.getLogger("llmesh.gateway")

WINDOW_S = 60
DAY_S = 86_400
REASON_RPM = "KEY_RPM_EXCEEDED"
REASON_TPM = "KEY_TPM_EXCEEDED"
REASON_TPD = "KEY_DAILY_BUDGET_EXHAUSTED"
LIMIT_OF_CODE = {1: "rpm", 2: "tpm", 3: "tpd"}
# A key is decided locally while its use stays this far below a limit.
NEAR_FRACTION = 0.2
NEAR_MIN = 5


def _until(seconds: float) -> str:
    seconds = max(0, math.ceil(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


class KeyLimitExceeded(ResourceExhausted):
    """A key over one of its own limits: RESOURCE_EXHAUSTED (HTTP 429) with the retry delay and
    which limit (`limit`: rpm, tpm or tpd); not an overload, so not counted as a shed."""

    def __init__(self, key_id: str, limit: str, value: int, used: int, retry_after: float) -> None:
        retry_after = max(0.001, retry_after)
        if limit == "tpd":
            message = (
                f"API key {key_id} has used its daily budget of {value} tokens ({used} today); "
                f"it resets at 00:00 UTC, in {_until(retry_after)}"
            )
            reason = REASON_TPD
        elif limit == "rpm":
            message = (
                f"API key {key_id} is over its limit of {value} requests per minute; retry in {_until(retry_after)}"
            )
            reason = REASON_RPM
        else:
            message = (
                f"API key {key_id} is over its limit of {value} tokens per minute ({used} in the last minute); "
                f"retry in {_until(retry_after)}"
            )
            reason = REASON_TPM
        super().__init__(
            message,
            retry_after=retry_after,
            reason=reason,
            metadata={"key_id": key_id, "limit": limit, "limit_value": str(value), "used": str(used)},
        )
        self.limit = limit


@dataclass
class _Counts:
    """One key's traffic as one party knows it: requests and tokens per second of the last
    minute, tokens of the current UTC day."""

    requests: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    day: int = -1
    day_tokens: int = 0

    def _trim(self, now: float) -> None:
        cutoff = int(now) - WINDOW_S
        for buckets in (self.requests, self.tokens):
            for second in [s for s in buckets if s <= cutoff]:
                del buckets[second]
        if int(now // DAY_S) != self.day:
            self.day, self.day_tokens = int(now // DAY_S), 0

    def add_request(self, now: float) -> None:
        self._trim(now)
        self.requests[int(now)] = self.requests.get(int(now), 0) + 1

    def add_tokens(self, now: float, tokens: int) -> None:
        self._trim(now)
        self.tokens[int(now)] = self.tokens.get(int(now), 0) + tokens
        self.day_tokens += tokens

    def refusal(self, key_id: str, limits: KeyLimits, now: float, share: float = 1.0) -> KeyLimitExceeded | None:
        """The refusal of one more request, each limit scaled by `share` (a replica's part)."""
        self._trim(now)

        def scaled(limit: int) -> int:
            return max(1, int(limit * share))

        if limits.tpd and self.day_tokens >= scaled(limits.tpd):
            return KeyLimitExceeded(key_id, "tpd", scaled(limits.tpd), self.day_tokens, (self.day + 1) * DAY_S - now)
        requests = sum(self.requests.values())
        if limits.rpm and requests + 1 > scaled(limits.rpm):
            retry = _leaves(self.requests, requests + 1 - scaled(limits.rpm), now)
            return KeyLimitExceeded(key_id, "rpm", scaled(limits.rpm), requests, retry)
        tokens = sum(self.tokens.values())
        if limits.tpm and tokens >= scaled(limits.tpm):
            retry = _leaves(self.tokens, tokens - scaled(limits.tpm) + 1, now)
            return KeyLimitExceeded(key_id, "tpm", scaled(limits.tpm), tokens, retry)
        return None


def _leaves(buckets: dict[int, int], need: int, now: float) -> float:
    """Seconds until `need` of the window's count has left it (oldest first)."""
    gone = 0
    for second in sorted(buckets):
        gone += buckets[second]
        if gone >= need:
            return second + WINDOW_S - now
    return float(WINDOW_S)


# KEYS: requests hash, tokens hash, day hash (one hash slot: the key id in braces).
# ARGV: take (1: check and count one request), pending requests, pending tokens, rpm, tpm, tpd.
# Returns {code (0 ok, 1 rpm, 2 tpm, 3 tpd), retry ms, requests, tokens in the window, tokens today}.
_LUA = """
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec + tonumber(t[2]) / 1000000
local day = math.floor(sec / 86400)
local W = 60
local take, dreq, dtok = ARGV[1] == '1', tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm, tpd = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local function window(key)
  local all = redis.call('HGETALL', key)
  local total, old, kept = 0, {}, {}
  for i = 1, #all, 2 do
    local s, c = tonumber(all[i]), tonumber(all[i + 1])
    if s <= sec - W then old[#old + 1] = all[i] else total = total + c; kept[#kept + 1] = {s, c} end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  return total, kept
end
local function leaves(kept, need)
  table.sort(kept, function(a, b) return a[1] < b[1] end)
  local gone = 0
  for _, b in ipairs(kept) do
    gone = gone + b[2]
    if gone >= need then return b[1] + W - now end
  end
  return W
end
if dreq > 0 then redis.call('HINCRBY', KEYS[1], sec, dreq) end
if dtok > 0 then
  redis.call('HINCRBY', KEYS[2], sec, dtok)
  redis.call('HINCRBY', KEYS[3], day, dtok)
end
local reqs, rk = window(KEYS[1])
local toks, tk = window(KEYS[2])
local today = 0
local days = redis.call('HGETALL', KEYS[3])
for i = 1, #days, 2 do
  local d = tonumber(days[i])
  if d == day then today = tonumber(days[i + 1]) elseif d < day then redis.call('HDEL', KEYS[3], days[i]) end
end
local code, retry = 0, 0
if take then
  if tpd > 0 and today >= tpd then code, retry = 3, (day + 1) * 86400 - now
  elseif rpm > 0 and reqs + 1 > rpm then code, retry = 1, leaves(rk, reqs + 1 - rpm)
  elseif tpm > 0 and toks >= tpm then code, retry = 2, leaves(tk, toks - tpm + 1)
  else
    redis.call('HINCRBY', KEYS[1], sec, 1)
    reqs = reqs + 1
  end
end
redis.call('EXPIRE', KEYS[1], W * 2)
redis.call('EXPIRE', KEYS[2], W * 2)
redis.call('EXPIRE', KEYS[3], 2 * 86400)
return {code, math.ceil(retry * 1000), reqs, toks, today}
"""


@dataclass
class _KeyState:
    local: _Counts = field(default_factory=_Counts)  # this process's own traffic
    # Cluster-wide use as last read from Redis: (local clock then, requests, tokens, tokens today).
    view: tuple[float, int, int, int] | None = None
    pending_requests: int = 0  # counted here, not yet pushed to Redis
    pending_tokens: int = 0
    limits: KeyLimits = field(default_factory=KeyLimits)
    touched: float = 0.0

    def saw(self, now: float, requests: int, tokens: int, today: int, within: float) -> None:
        """Takes a use Redis reported. Concurrent calls' replies come back in any order, so a
        reply that resumes last may be the oldest: within `within` seconds of the last view the
        highest use read stands (a lower count there is an earlier reading, not requests leaving
        the window), else a key near its limit would look far from it and be admitted locally."""
        if self.view is not None and now - self.view[0] <= within:
            seen, r, t, d = self.view
            now, requests, tokens, today = max(now, seen), max(requests, r), max(tokens, t), max(today, d)
        self.view = (now, requests, tokens, today)


def _margin(limit: int) -> int:
    return max(NEAR_MIN, math.ceil(limit * NEAR_FRACTION))


class KeyLimiter:
    """Checks and counts each key's requests (`admit`) and tokens (`record`)."""

    MAX_KEYS = 100_000

    def __init__(
        self,
        redis: Any | None = None,
        *,
        replicas: int = 1,
        clock: Callable[[], float] = time.time,
        sync_seconds: float = 0.1,
        op_timeout: float = 0.25,
        retry_seconds: float = 1.0,
        prefix: str = "llmesh:keylimit",
    ) -> None:
        self.redis = redis
        self.replicas = max(1, replicas)
        self.clock = clock
        self.sync_seconds = sync_seconds
        self.op_timeout = op_timeout
        self.retry_seconds = retry_seconds
        self.prefix = prefix
        self.keys: dict[str, _KeyState] = {}
        self.redis_ok = True
        self._retry_at = 0.0
        self._script: Any = None
        self._errors: tuple[type[BaseException], ...] = (TimeoutError, OSError)
        if redis is not None:
            from redis.exceptions import RedisError

            self._errors = (RedisError, TimeoutError, OSError)
            self._script = redis.register_script(_LUA)
        self._task: asyncio.Task[None] | None = None

    def _state(self, key_id: str, limits: KeyLimits, now: float) -> _KeyState:
        st = self.keys.get(key_id)
        if st is None:
            if len(self.keys) >= self.MAX_KEYS:
                self.keys.pop(next(iter(self.keys)))
            st = self.keys[key_id] = _KeyState()
        st.limits, st.touched = limits, now
        return st

    def _redis_keys(self, key_id: str) -> list[str]:
        tag = "{" + f"{self.prefix}:{key_id}" + "}"
        return [f"{tag}:r", f"{tag}:t", f"{tag}:d"]

    def _far(self, st: _KeyState, limits: KeyLimits, now: float) -> bool:
        """Whether the key's use, as last read plus this replica's since, is far below every limit."""
        if st.view is None or now - st.view[0] > max(1.0, 5 * self.sync_seconds):
            return False
        _, requests, tokens, today = st.view
        if limits.rpm and requests + st.pending_requests + 1 > limits.rpm - _margin(limits.rpm):
            return False
        if limits.tpm and tokens + st.pending_tokens >= limits.tpm - _margin(limits.tpm):
            return False
        return not (limits.tpd and today + st.pending_tokens >= limits.tpd - _margin(limits.tpd))

    async def admit(self, key_id: str, limits: KeyLimits) -> None:
        """Counts one request of the key; KeyLimitExceeded when it is over a limit."""
        if not limits.any:
            return
        now = self.clock()
        st = self._state(key_id, limits, now)
        if self.redis is None:
            refusal = st.local.refusal(key_id, limits, now)
            if refusal is not None:
                raise refusal
            st.local.add_request(now)
            return
        if self._far(st, limits, now):
            st.pending_requests += 1
            st.local.add_request(now)
            return
        try:
            code, retry_ms, requests, tokens, today = await self._eval(key_id, st, take=True)
        except self._errors as exc:
            self._down(exc)
            refusal = st.local.refusal(key_id, limits, now, 1 / self.replicas)
            if refusal is not None:
                raise refusal from None
            st.local.add_request(now)
            return
        st.saw(now, requests, tokens, today, self.sync_seconds)
        if code:
            limit = LIMIT_OF_CODE[code]
            value = getattr(limits, limit)
            used = {"rpm": requests, "tpm": tokens, "tpd": today}[limit]
            raise KeyLimitExceeded(key_id, limit, value, used, retry_ms / 1000)
        st.local.add_request(now)

    def record(self, key_id: str, limits: KeyLimits, tokens: int) -> None:
        """Counts the tokens a response of the key generated (pushed to Redis with the next sync)."""
        if not limits.any or tokens <= 0:
            return
        now = self.clock()
        st = self._state(key_id, limits, now)
        st.local.add_tokens(now, tokens)
        if self.redis is not None and self.redis_ok:
            st.pending_tokens += tokens

    def _down(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("key limits: redis unreachable (%s), each replica enforces its share locally", exc)
        self.redis_ok = False
        self._retry_at = time.monotonic() + self.retry_seconds

    async def _eval(self, key_id: str, st: _KeyState, take: bool) -> tuple[int, int, int, int, int]:
        if not self.redis_ok and time.monotonic() < self._retry_at:
            raise TimeoutError("redis marked down")
        limits = st.limits
        requests, tokens = st.pending_requests, st.pending_tokens
        st.pending_requests = st.pending_tokens = 0
        args = [1 if take else 0, requests, tokens, limits.rpm, limits.tpm, limits.tpd]
        try:
            reply = await asyncio.wait_for(self._script(keys=self._redis_keys(key_id), args=args), self.op_timeout)
        except BaseException:
            st.pending_requests += requests  # not counted there: pushed with the next call
            st.pending_tokens += tokens
            raise
        if not self.redis_ok:
            log.info("key limits: redis reachable again, limits are cluster-wide again")
        self.redis_ok = True
        code, retry_ms, reqs, toks, today = (int(v) for v in reply)
        return code, retry_ms, reqs, toks, today

    async def sync(self) -> None:
        """Pushes what this replica counted and reads the cluster's use back, for every key used
        in the last minute (one round trip)."""
        if self.redis is None or (not self.redis_ok and time.monotonic() < self._retry_at):
            return
        now = self.clock()
        active = [(k, st) for k, st in self.keys.items() if now - st.touched <= WINDOW_S and st.limits.any]
        if not active:
            return
        pushed = [(st.pending_requests, st.pending_tokens) for _, st in active]
        for _, st in active:
            st.pending_requests = st.pending_tokens = 0
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for (key_id, st), (requests, tokens) in zip(active, pushed, strict=True):
                    limits = st.limits
                    args = [0, requests, tokens, limits.rpm, limits.tpm, limits.tpd]
                    await self._script(keys=self._redis_keys(key_id), args=args, client=pipe)
                replies = await asyncio.wait_for(pipe.execute(), self.op_timeout * 4)
        except self._errors as exc:
            for (_, st), (requests, tokens) in zip(active, pushed, strict=True):
                st.pending_requests += requests
                st.pending_tokens += tokens
            self._down(exc)
            return
        self.redis_ok = True
        for (_, st), reply in zip(active, replies, strict=True):
            _, _, reqs, toks, today = (int(v) for v in reply)
            st.saw(now, reqs, toks, today, self.sync_seconds)

    async def run(self) -> None:
        """Syncs every `sync_seconds` until cancelled."""
        while True:
            await asyncio.sleep(self.sync_seconds)
            try:
                await self.sync()
            except Exception:
                log.exception("key limits sync failed")

    def start(self) -> None:
        if self.redis is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self._task is not None:
            # tasks.stop, not one cancel(): a cancellation landing as a sync's Redis reply
            # arrives is swallowed by wait_for on 3.11, and the loop would run on forever.
            await tasks.stop(self._task)
            self._task = None
            with contextlib.suppress(*self._errors):
                await self.sync()  # what was counted here reaches the others
