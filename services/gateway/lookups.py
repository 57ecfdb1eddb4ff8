"""The gateway's cache lookups, coalesced into LookupBatch calls under load (`LookupCoalescer`)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from llmesh.v1 import cache_pb2
from services.gateway import metrics
from services.gateway.deadline import CallerDeadline, Deadline

tracer = trace.get_tracer("llmesh.gateway")
# Lookups that queue behind these many calls in flight go together in one LookupBatch call. One:
# under load a call carries ~4 lookups instead of ~2 (each call costs the gateway and the cache
# far more than a lookup does), and an idle cache still answers a lone lookup at once.
LOOKUPS_IN_FLIGHT = 1
MAX_LOOKUP_BATCH = 64
# A call that returns leaves the lookups queued meanwhile for up to LINGER_TURNS loop turns in
# which no new lookup joins (and LINGER_MAX_S at most), so each call carries more of them: under
# gRPC load, grpc.aio hands the loop one new request per turn, and a call that went as soon as the
# last returned carried ~4 lookups (HTTP's bursts gave ~20). An idle loop turns in microseconds, so
# a lone caller, or a few, wait next to nothing; a saturated one turns slowly and the batch fills.
LINGER_TURNS = 8
LINGER_MAX_S = 0.005

LookupRequest = cache_pb2.CacheLookupRequest
LookupResponse = cache_pb2.CacheLookupResponse
LookupBatchResponse = cache_pb2.CacheLookupBatchResponse


@dataclass
class _QueuedLookup:
    request: cache_pb2.CacheLookupRequest
    deadline: Deadline
    future: asyncio.Future[cache_pb2.CacheLookupResponse]
    context: otel_context.Context


class LookupCoalescer:
    """Cache lookups without a gRPC call each under load ("smart batching", no timer).

    Lookups made in one turn of the event loop go out together at the start of the next turn, as
    one call while fewer than `in_flight` calls are out; lookups that arrive while that many are
    out queue. When a call returns, the queue lingers for as long as new lookups keep joining it
    (until `linger_turns` loop turns pass with none, `linger_max` seconds at most, or
    `max_batch` are queued), then goes out as one LookupBatch. One client at a time sees plain
    Lookup calls and no added latency (one loop turn); 64 clients share a few calls a
    millisecond and one Redis round trip per batch. A batch's span is a child of its first
    request and is linked from every request it carried.

    Every member keeps its own deadline: it waits for its answer no longer than that, and a
    member whose deadline ran out fails alone (CallerDeadline), never the batch. The batch call
    runs to the latest of its members' deadlines, within the hop's budget (`Peers`)."""

    def __init__(
        self,
        lookup: Callable[[cache_pb2.CacheLookupRequest, Deadline], Awaitable[cache_pb2.CacheLookupResponse]],
        lookup_batch: Callable[
            [cache_pb2.CacheLookupBatchRequest, Deadline], Awaitable[cache_pb2.CacheLookupBatchResponse]
        ],
        in_flight: int = LOOKUPS_IN_FLIGHT,
        max_batch: int = MAX_LOOKUP_BATCH,
        linger_turns: int = LINGER_TURNS,
        linger_max: float = LINGER_MAX_S,
    ) -> None:
        self._lookup = lookup
        self._lookup_batch = lookup_batch
        self.max_in_flight = in_flight
        self.max_batch = max_batch
        self.in_flight = 0
        self._queue: list[_QueuedLookup] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._flush_due = False
        self.linger_turns = linger_turns
        self.linger_max = linger_max
        self._linger: asyncio.Handle | None = None
        self._linger_seen = 0
        self._linger_quiet = 0
        self._linger_until = 0.0
        # Calls made and lookups they carried, since start.
        self.calls = 0
        self.sent = 0

    async def lookup(self, request: cache_pb2.CacheLookupRequest, deadline: Deadline) -> cache_pb2.CacheLookupResponse:
        left = deadline.check("cache")
        loop = asyncio.get_running_loop()
        queued = _QueuedLookup(request, deadline, loop.create_future(), otel_context.get_current())
        self._queue.append(queued)
        if self._linger is not None:
            if len(self._queue) >= self.max_batch:
                self._linger.cancel()
                self._flush_linger()
        elif not self._flush_due and self.in_flight < self.max_in_flight:
            self._flush_due = True
            loop.call_soon(self._flush_turn)
        try:
            # Cancelled on timeout: a batch not sent yet leaves it out.
            return await asyncio.wait_for(queued.future, left)
        except TimeoutError:
            raise CallerDeadline("cache: the request's deadline ran out while its lookup waited") from None

    def _flush_turn(self) -> None:
        self._flush_due = False
        self._flush()

    def _flush_linger(self) -> None:
        self._linger = None
        self._flush()

    def _after_call(self) -> None:
        """A call returned: the lookups queued meanwhile linger while new ones keep joining (see
        LINGER_TURNS), then go out as one call."""
        if not self._queue or self._linger is not None:
            return
        if len(self._queue) >= self.max_batch or self.linger_turns <= 0:
            self._flush()
            return
        loop = asyncio.get_running_loop()
        self._linger_seen = len(self._queue)
        self._linger_quiet = 0
        self._linger_until = loop.time() + self.linger_max
        self._linger = loop.call_soon(self._linger_turn)

    def _linger_turn(self) -> None:
        n = len(self._queue)
        if n > self._linger_seen:
            self._linger_quiet = 0
        else:
            self._linger_quiet += 1
            if all(q.future.done() for q in self._queue):  # every caller queued gave up
                self._linger_quiet = self.linger_turns
        self._linger_seen = n
        if (
            self._linger_quiet < self.linger_turns
            and n < self.max_batch
            and asyncio.get_running_loop().time() < self._linger_until
        ):
            self._linger = asyncio.get_running_loop().call_soon(self._linger_turn)
            return
        self._linger = None
        self._flush()

    def _flush(self) -> None:
        while self._queue and self.in_flight < self.max_in_flight:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            batch = [q for q in batch if not q.future.done()]  # callers that gave up
            if not batch:
                continue
            self.in_flight += 1
            self.calls += 1
            self.sent += len(batch)
            metrics.CACHE_LOOKUP_BATCH.observe(len(batch))
            # The batch runs in its first request's trace context, not in whichever request's
            # finally happened to flush it.
            task = asyncio.get_running_loop().create_task(self._send(batch), context=_context_copy(batch[0].context))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_QueuedLookup]) -> None:
        try:
            # The batch ends with the latest of its callers' deadlines: each caller waits only as
            # long as its own (`lookup`), and one near its end never fails the others.
            deadline = Deadline(max(q.deadline.expires_at for q in batch))
            if len(batch) == 1:
                results = [await self._lookup(batch[0].request, deadline)]
            else:
                with tracer.start_as_current_span(
                    "gateway.cache_lookup_batch",
                    attributes={"llmesh.cache.batch_size": len(batch)},
                ) as span:
                    for q in batch:
                        trace.get_current_span(q.context).add_link(span.get_span_context())
                    request = cache_pb2.CacheLookupBatchRequest(requests=[q.request for q in batch])
                    results = list((await self._lookup_batch(request, deadline)).results)
            for q, result in zip(batch, results, strict=True):
                if not q.future.done():
                    q.future.set_result(result)
        except Exception as exc:
            for q in batch:
                if not q.future.done():
                    q.future.set_exception(exc)
        finally:
            self.in_flight -= 1
            self._after_call()


def _context_copy(otel: otel_context.Context) -> contextvars.Context:
    token = otel_context.attach(otel)
    try:
        return contextvars.copy_context()
    finally:
        otel_context.detach(token)
