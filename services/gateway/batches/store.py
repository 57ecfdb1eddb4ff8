"""Batch jobs, their files and their results in the mesh's state Redis (noeviction, append-only):
what survives a gateway's restart, and what lets any replica carry on another's job.

Keys, under one prefix:
- `file:{id}` (hash: the file's fields) and `file:{id}:data` (its bytes);
- `batch:{id}` (hash: the job's fields, its counts, its cursor over the input lines);
- `batch:{id}:lines` (hash: line number -> the request line, as validated);
- `batch:{id}:done` (hash: line number -> its output line, `o` or `e` first: output or error file);
- `batch:{id}:claims` (sorted set: line number, scored by when its lease runs out, in ms);
- `tenant:{t}:files`, `tenant:{t}:batches` (sorted sets by creation: the tenant's own lists);
- `active` (set: the jobs some replica should be working on).

A line is claimed with a lease (a script: the expired claims of lines not done first, then the
next lines from the cursor), its lease renewed while it runs, and completed by one script that
writes the result and marks it done only if no one did first: a line is never done twice, and a
line whose runner died is claimed again once its lease runs out.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "llmesh:batch:"
OUTPUT, ERROR = "o", "e"
# Statuses past which nothing changes.
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
# Statuses that count against the tenant's batches in flight.
IN_FLIGHT = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")

# Claims up to ARGV[3] lines of one batch for ARGV[2] ms from now (ARGV[1]): expired claims of
# lines not done first, then lines from the cursor that were not done at validation.
CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return {} end
local now, lease, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local got = {}
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, want)
for _, line in ipairs(expired) do
  if redis.call('HEXISTS', KEYS[3], line) == 1 then
    redis.call('ZREM', KEYS[2], line)
  else
    redis.call('ZADD', KEYS[2], now + lease, line)
    got[#got + 1] = line
  end
end
local total = tonumber(redis.call('HGET', KEYS[1], 'total'))
while #got < want do
  local cursor = tonumber(redis.call('HGET', KEYS[1], 'cursor'))
  if cursor >= total then break end
  redis.call('HINCRBY', KEYS[1], 'cursor', 1)
  local line = tostring(cursor)
  if redis.call('HEXISTS', KEYS[3], line) == 0 then
    redis.call('ZADD', KEYS[2], now + lease, line)
    got[#got + 1] = line
  end
end
return got
"""

# Writes line ARGV[1]'s result (ARGV[2]: kind and line) and counts it (ARGV[3]: the count's
# field), once: 0 when the line was done already or the job is being finalized.
COMPLETE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
return 1
"""

# Sets the status ARGV[2] (and the field ARGV[3] to ARGV[4]) only from one of ARGV[1] (comma-separated).
TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if status == allowed then
    redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[3], ARGV[4])
    return 1
  end
end
return 0
"""


def new_id(kind: str) -> str:
    return f"{kind}-{secrets.token_hex(12)}"


def now_s() -> int:
    return int(time.time())


@dataclass(frozen=True)
class FileInfo:
    id: str
    tenant: str
    key_id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    lines: int

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }

    @classmethod
    def of(cls, fields: dict[str, str]) -> FileInfo:
        return cls(
            id=fields["id"],
            tenant=fields["tenant"],
            key_id=fields.get("key_id", ""),
            filename=fields.get("filename", ""),
            purpose=fields.get("purpose", ""),
            bytes=int(fields.get("bytes", 0)),
            created_at=int(fields.get("created_at", 0)),
            lines=int(fields.get("lines", 0)),
        )


@dataclass(frozen=True)
class BatchInfo:
    """A batch job as its hash holds it."""

    fields: dict[str, str]

    @property
    def id(self) -> str:
        return self.fields["id"]

    @property
    def tenant(self) -> str:
        return self.fields["tenant"]

    @property
    def key_id(self) -> str:
        return self.fields.get("key_id", "")

    @property
    def status(self) -> str:
        return self.fields.get("status", "")

    @property
    def endpoint(self) -> str:
        return self.fields.get("endpoint", "")

    @property
    def total(self) -> int:
        return int(self.fields.get("total", 0))

    @property
    def completed(self) -> int:
        return int(self.fields.get("completed", 0))

    @property
    def failed(self) -> int:
        return int(self.fields.get("failed", 0))

    @property
    def expires_at(self) -> int:
        return int(self.fields.get("expires_at", 0))

    @property
    def traceparent(self) -> str:
        return self.fields.get("traceparent", "")

    def _time(self, name: str) -> int | None:
        value = self.fields.get(name)
        return int(value) if value else None

    def as_openai(self) -> dict[str, Any]:
        errors = json.loads(self.fields["errors"]) if self.fields.get("errors") else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": self.fields.get("input_file_id", ""),
            "completion_window": self.fields.get("completion_window", "24h"),
            "status": self.status,
            "output_file_id": self.fields.get("output_file_id") or None,
            "error_file_id": self.fields.get("error_file_id") or None,
            "created_at": self._time("created_at"),
            "in_progress_at": self._time("in_progress_at"),
            "expires_at": self._time("expires_at"),
            "finalizing_at": self._time("finalizing_at"),
            "completed_at": self._time("completed_at"),
            "failed_at": self._time("failed_at"),
            "expired_at": self._time("expired_at"),
            "cancelling_at": self._time("cancelling_at"),
            "cancelled_at": self._time("cancelled_at"),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": json.loads(self.fields["metadata"]) if self.fields.get("metadata") else None,
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in raw.items()}


class BatchStore:
    """The batch state of one Redis (a redis.asyncio client)."""

    def __init__(self, redis: Any, prefix: str = PREFIX) -> None:
        self.redis = redis
        self.prefix = prefix
        self._claim = redis.register_script(CLAIM)
        self._complete = redis.register_script(COMPLETE)
        self._transition = redis.register_script(TRANSITION)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # Files.

    async def put_file(self, info: FileInfo, data: bytes) -> None:
        fields = {k: str(v) for k, v in info.__dict__.items()}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.key("file", info.id, "data"), data)
            pipe.hset(self.key("file", info.id), mapping=fields)
            pipe.zadd(self.key("tenant", info.tenant, "files"), {info.id: info.created_at})
            await pipe.execute()

    async def file(self, file_id: str) -> FileInfo | None:
        fields = _fields(await self.redis.hgetall(self.key("file", file_id)))
        return FileInfo.of(fields) if fields else None

    async def file_data(self, file_id: str) -> bytes | None:
        data = await self.redis.get(self.key("file", file_id, "data"))
        return bytes(data) if data is not None else None

    async def files(self, tenant: str, limit: int = 100) -> list[FileInfo]:
        ids = await self.redis.zrevrange(self.key("tenant", tenant, "files"), 0, limit - 1)
        found = [await self.file(_text(i)) for i in ids]
        return [f for f in found if f is not None]

    async def delete_file(self, info: FileInfo) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key("file", info.id), self.key("file", info.id, "data"))
            pipe.zrem(self.key("tenant", info.tenant, "files"), info.id)
            await pipe.execute()

    # Batches.

    async def create_batch(
        self, fields: dict[str, str], lines: dict[int, str], failed: dict[int, str], active: bool = True
    ) -> None:
        """A validated job, its lines to run, and the lines that failed validation (already done,
        in the error file): in one transaction, so a job is never seen half written."""
        batch_id, tenant = fields["id"], fields["tenant"]
        async with self.redis.pipeline(transaction=True) as pipe:
            if lines:
                pipe.hset(self.key("batch", batch_id, "lines"), mapping={str(i): v for i, v in lines.items()})
            if failed:
                pipe.hset(self.key("batch", batch_id, "done"), mapping={str(i): ERROR + v for i, v in failed.items()})
            pipe.hset(self.key("batch", batch_id), mapping={**fields, "failed": str(len(failed))})
            pipe.zadd(self.key("tenant", tenant, "batches"), {batch_id: float(fields["created_at"])})
            if active:
                pipe.sadd(self.key("active"), batch_id)
            await pipe.execute()

    async def batch(self, batch_id: str) -> BatchInfo | None:
        fields = _fields(await self.redis.hgetall(self.key("batch", batch_id)))
        return BatchInfo(fields) if fields else None

    async def batches(self, tenant: str, after: str = "", limit: int = 20) -> tuple[list[BatchInfo], bool]:
        """The tenant's batches, newest first, from after the id `after`; whether more follow."""
        key = self.key("tenant", tenant, "batches")
        start = 0
        if after:
            rank = await self.redis.zrevrank(key, after)
            start = 0 if rank is None else rank + 1
        ids = await self.redis.zrevrange(key, start, start + limit)
        found = [await self.batch(_text(i)) for i in ids[:limit]]
        return [b for b in found if b is not None], len(ids) > limit

    async def in_flight(self, tenant: str) -> int:
        """The tenant's batches not yet ended (the newest ones: ended ones are rarely recent)."""
        ids = await self.redis.zrevrange(self.key("tenant", tenant, "batches"), 0, -1)
        active = await self.redis.smembers(self.key("active"))
        active_ids = {_text(a) for a in active}
        return sum(1 for i in ids if _text(i) in active_ids)

    async def active(self) -> list[str]:
        return sorted(_text(i) for i in await self.redis.smembers(self.key("active")))

    async def transition(self, batch_id: str, allowed: Iterable[str], status: str) -> bool:
        """Sets `status` (and its `{status}_at` time) if the job's status is one of `allowed`."""
        done = await self._transition(
            keys=[self.key("batch", batch_id)], args=[",".join(allowed), status, f"{status}_at", str(now_s())]
        )
        return bool(done)

    async def set_fields(self, batch_id: str, fields: dict[str, str]) -> None:
        await self.redis.hset(self.key("batch", batch_id), mapping=fields)

    def _line_keys(self, batch_id: str) -> list[str]:
        return [self.key("batch", batch_id), self.key("batch", batch_id, "claims"), self.key("batch", batch_id, "done")]

    async def claim(self, batch_id: str, want: int, lease_s: float) -> list[int]:
        """Up to `want` line numbers of the job, each leased to the caller for `lease_s`."""
        now_ms = int(time.time() * 1000)
        got = await self._claim(keys=self._line_keys(batch_id), args=[now_ms, int(lease_s * 1000), want])
        return [int(_text(g)) for g in got]

    async def line(self, batch_id: str, line: int) -> str | None:
        raw = await self.redis.hget(self.key("batch", batch_id, "lines"), str(line))
        return _text(raw) if raw is not None else None

    async def renew(self, batch_id: str, lines: Sequence[int], lease_s: float) -> None:
        """Extends the leases of lines still claimed (a line done meanwhile is left alone)."""
        if lines:
            until = int(time.time() * 1000 + lease_s * 1000)
            await self.redis.zadd(self.key("batch", batch_id, "claims"), {str(i): until for i in lines}, xx=True)

    async def release(self, batch_id: str, lines: Sequence[int]) -> None:
        """Gives lines back for anyone to claim now (a line refused for load, a runner stopping)."""
        if lines:
            await self.redis.zadd(self.key("batch", batch_id, "claims"), {str(i): 0 for i in lines}, xx=True)

    async def complete(self, batch_id: str, line: int, kind: str, output: str) -> bool:
        """Records a line's result once: False when it was done already (by another runner)."""
        count = "completed" if kind == OUTPUT else "failed"
        done = await self._complete(keys=self._line_keys(batch_id), args=[str(line), kind + output, count])
        return bool(done)

    async def live_claims(self, batch_id: str) -> int:
        now_ms = int(time.time() * 1000)
        return int(await self.redis.zcount(self.key("batch", batch_id, "claims"), f"({now_ms}", "+inf"))

    async def results(self, batch_id: str) -> dict[int, str]:
        """Every line done so far: line number -> kind + output line."""
        raw = await self.redis.hgetall(self.key("batch", batch_id, "done"))
        return {int(_text(k)): _text(v) for k, v in raw.items()}

    async def lock_finalizing(self, batch_id: str, seconds: float) -> bool:
        """One replica finalizes a job at a time (the lock expires should it die doing it)."""
        return bool(
            await self.redis.set(self.key("batch", batch_id, "finalizer"), "1", nx=True, ex=max(1, int(seconds)))
        )

    async def finish(self, batch_id: str, fields: dict[str, str], files: Sequence[tuple[FileInfo, bytes]]) -> None:
        """The job's result files and its final fields, at once; the job leaves the active set and
        its working state (lines, claims, results) is dropped: the files hold what it made."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for info, data in files:
                pipe.set(self.key("file", info.id, "data"), data)
                pipe.hset(self.key("file", info.id), mapping={k: str(v) for k, v in info.__dict__.items()})
                pipe.zadd(self.key("tenant", info.tenant, "files"), {info.id: info.created_at})
            pipe.hset(self.key("batch", batch_id), mapping=fields)
            pipe.srem(self.key("active"), batch_id)
            pipe.delete(
                self.key("batch", batch_id, "lines"),
                self.key("batch", batch_id, "claims"),
                self.key("batch", batch_id, "done"),
                self.key("batch", batch_id, "finalizer"),
            )
            await pipe.execute()

    async def counts_by_status(self) -> dict[str, int]:
        """Jobs by status, of the active set (what the gauge shows as in flight)."""
        counts = dict.fromkeys(STATUSES, 0)
        for batch_id in await self.active():
            status = await self.redis.hget(self.key("batch", batch_id), "status")
            if status is not None:
                counts[_text(status)] = counts.get(_text(status), 0) + 1
        return counts
