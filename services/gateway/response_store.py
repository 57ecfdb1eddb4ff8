"""Stored answers of the Responses API (`store`, its default): what `previous_response_id`
continues from and what GET and DELETE /v1/responses/{id} find.

Each record is kept per tenant, with a fixed lifetime, in the gateway replicas' shared state Redis
(LLMESH_STATE_REDIS_URL, else LLMESH_ADMISSION_REDIS_URL; the one batch jobs are kept in), so
that any replica finds what another stored. Without that Redis the records live in this process, bounded
in bytes (the oldest go first). A tenant's key never reads another tenant's record: the tenant is
part of the key, and a record of another tenant is "not found", never "forbidden".

A record is JSON: the response object as the API returned it, and the conversation that
produced it (the turns before it and its own answer), which a next request is given as its
earlier turns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmesh.errors import Unavailable

log = logging.getLogger("llmesh.gateway.responses")

# The in-process store's bound: past it the oldest records are dropped.
MEMORY_BYTES = 64 * 1024 * 1024
KEY_PREFIX = "llmesh:responses:"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    # The conversation as the gateway's turns (role, content, tool_call_id, tool_calls) in order,
    # the answer last; the request's instructions are not part of it (they do not carry over).
    turns: list[dict[str, Any]]

    def encode(self) -> bytes:
        return json.dumps({"response": self.response, "turns": self.turns}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> StoredResponse:
        value = json.loads(raw)
        return cls(value["response"], value["turns"])


class MemoryResponses:
    """Records in this process: per tenant, each with its expiry, the whole bounded in bytes."""

    def __init__(
        self, ttl_seconds: float, max_bytes: int = MEMORY_BYTES, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl_seconds
        self.clock = clock
        self.max_bytes = max_bytes
        self.size = 0
        self.records: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()

    async def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        raw = record.encode()
        self._drop((tenant, response_id))
        self.records[(tenant, response_id)] = (self.clock() + self.ttl, raw)
        self.size += len(raw)
        while self.size > self.max_bytes and self.records:
            self._drop(next(iter(self.records)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        found = self.records.get((tenant, response_id))
        if found is None:
            return None
        if found[0] <= self.clock():
            self._drop((tenant, response_id))
            return None
        return StoredResponse.decode(found[1])

    async def delete(self, tenant: str, response_id: str) -> bool:
        found = self.records.get((tenant, response_id))
        self._drop((tenant, response_id))
        return found is not None and found[0] > self.clock()

    def _drop(self, key: tuple[str, str]) -> None:
        old = self.records.pop(key, None)
        if old is not None:
            self.size -= len(old[1])


class RedisResponses:
    """Records in the shared state Redis, one string per response with its TTL."""

    def __init__(self, redis: Any, ttl_seconds: int, op_timeout: float = 1.0) -> None:
        self.redis = redis
        self.ttl = ttl_seconds
        self.op_timeout = op_timeout
        from redis.exceptions import RedisError

        self._errors = (RedisError, TimeoutError, OSError)

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        return f"{KEY_PREFIX}{tenant}:{response_id}"

    async def _call(self, what: str, op: Any) -> Any:
        try:
            return await asyncio.wait_for(op, self.op_timeout)
        except self._errors as exc:
            log.warning("stored responses: redis unreachable (%s)", exc)
            raise Unavailable(
                f"stored responses are unavailable: cannot {what}", reason="RESPONSE_STORE_DOWN"
            ) from None

    async def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        await self._call("store", self.redis.set(self._key(tenant, response_id), record.encode(), ex=self.ttl))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self._call("read", self.redis.get(self._key(tenant, response_id)))
        return None if raw is None else StoredResponse.decode(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._call("delete", self.redis.delete(self._key(tenant, response_id))))


ResponseStore = MemoryResponses | RedisResponses
