"""Runs batch jobs' lines on this gateway, beside every other replica running the same jobs.

Each turn the runner claims as many lines as it has room for (leased; the lease renewed while a
line runs), runs each through the gateway's request path on the `batch` lane, and completes it
once in the store. Room is the lesser of two: the rows the engines' own load reports leave free
for batch work (`engine_room`: a share of each engine's rows, none where anything waits), and a
target number of lines at once, grown by one per line answered and halved when admission
refuses one (RESOURCE_EXHAUSTED: the batch lane's share is full, or interactive traffic needs the
engines): the refused line is given back and the runner waits out the refusal's retry delay
before claiming again. So batch work fills what interactive traffic leaves, and yields as soon
as the engines or admission say so.

A job whose lines are all done, whose cancel has taken effect, or whose window has passed is
finalized by whichever runner sees it first (under a lock): its output and error files written,
its working state dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from llmesh.errors import HTTP_STATUS, LlmeshError, retry_after_of
from services.gateway.admission import LoadBook
from services.gateway.auth import ANONYMOUS, ApiKey, Caller, KeyRing
from services.gateway.batches import metrics
from services.gateway.batches.lines import LineEndpoints
from services.gateway.batches.service import error_line
from services.gateway.batches.store import ERROR, OUTPUT, BatchInfo, BatchStore, FileInfo, new_id, now_s
from services.gateway.openai_http import error_body

log = logging.getLogger("llmesh.gateway.batch")
tracer = trace.get_tracer("llmesh.gateway.batch")

# The share of an engine's rows batch lines may fill (with what else runs there). All of them:
# the builtin engine preempts a batch row for an interactive request that needs it, and holds
# batch work to LLMESH_BATCH_ROWS_BESIDE_INTERACTIVE rows while interactive work is about, so
# idle rows are batch work's to fill.
BATCH_ROW_SHARE = 1.0
# Refusals that mean "not now": the line goes back and is run again later.
LOAD_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
# A line whose attempt ran out of time (engines too busy) is tried again, as a refused one, up
# to this many times on this gateway; then its timeout is its answer (a line that cannot finish
# within the deadline at all must not keep coming back for the job's whole window).
DEADLINE_RETRIES = 3
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.05, 5.0
FINALIZE_LOCK_S = 60.0
STOP_WAIT_S = 5.0


def output_line(request_id: str, custom_id: str, status: int, body: dict[str, Any]) -> str:
    """One line of a job's output (or error) file, in OpenAI's batch output shape."""
    line = {
        "id": request_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False)


def engine_room(loads: LoadBook, models: Sequence[str], share: float = BATCH_ROW_SHARE) -> int | None:
    """Rows batch lines may take now on the engines, by their own load reports: up to `share` of
    each replica's rows, and none on a replica where anything waits (interactive work queues
    there: batch work leaves it). None: no engine reports its load (the openai backend without
    metrics): admission's refusals alone pace the runner."""
    now = loads.clock()
    reports = [r for name in models for r in loads.model(name).fresh(now)]
    if not reports:
        return None
    return sum(0 if r.waiting else max(0, int(r.max_running * share) - r.running) for r in reports)


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        endpoints: LineEndpoints,
        keys: KeyRing,
        concurrency: int,
        lease_s: float,
        poll_s: float = 1.0,
        room: Callable[[], int | None] | None = None,
    ) -> None:
        self.store = store
        self.endpoints = endpoints
        self.keys = keys
        self.max_lines = max(1, concurrency)
        self.target = float(self.max_lines)
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.room = room  # rows the engines have for batch lines now (engine_room); None: unknown
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.timeouts: dict[tuple[str, int], int] = {}  # lines' attempts that ran out of time here
        self.paused_until = 0.0
        self.backoff_s = MIN_BACKOFF_S
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._renewed = 0.0
        metrics.LINES_TARGET.set(self.target)

    def wake(self) -> None:
        self._wakeup.set()

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self, release: bool = True) -> None:
        """Stops claiming and cancels the lines running here; `release` gives their claims back at
        once (a graceful stop), else they are run again when their leases run out (as after a crash)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        running = dict(self.running)
        for task in running.values():
            task.cancel()
        if running:
            # Bounded: a line whose request path is slow to unwind must not hold the drain up;
            # its claim is given back (or runs out) all the same.
            await asyncio.wait(running.values(), timeout=STOP_WAIT_S)
        if release:
            by_batch: dict[str, list[int]] = {}
            for batch_id, line in running:
                by_batch.setdefault(batch_id, []).append(line)
            for batch_id, lines in by_batch.items():
                with contextlib.suppress(Exception):
                    await self.store.release(batch_id, lines)

    async def _loop(self) -> None:
        while True:
            self._wakeup.clear()
            wait = min(self.poll_s, self.lease_s / 3)  # a turn renews the leases: often enough to keep them
            try:
                await self._turn()
            except Exception as exc:  # the state Redis away, mostly: try again in a while
                log.warning("batch runner: a turn failed: %s: %s", type(exc).__name__, exc)
                wait = MAX_BACKOFF_S
            pause = self.paused_until - time.monotonic()
            if pause > 0:
                wait = min(wait, pause)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait)

    async def _turn(self) -> None:
        ids = await self.store.active()
        infos = [b for b in [await self.store.batch(i) for i in ids] if b is not None]
        counts: dict[str, int] = {}
        for info in infos:
            counts[info.status] = counts.get(info.status, 0) + 1
            await self._tend(info)
        for status in ("in_progress", "cancelling", "finalizing"):
            metrics.BATCHES.labels(status).set(counts.get(status, 0))
        await self._renew()
        if time.monotonic() < self.paused_until:
            return
        free = self.room() if self.room is not None else None
        for info in infos:
            room = int(self.target) - len(self.running)
            if free is not None:
                room = min(room, free)
            if room <= 0:
                break
            if info.status != "in_progress":
                continue
            claimed = await self.store.claim(info.id, room, self.lease_s)
            if free is not None:
                free -= len(claimed)
            for line in claimed:
                if (info.id, line) in self.running:
                    continue  # its lease ran out while it ran here (a stalled loop): it runs on, renewed
                task = asyncio.get_running_loop().create_task(self._guarded(info, line))
                self.running[(info.id, line)] = task
                task.add_done_callback(lambda _, key=(info.id, line): self._ended(key))  # type: ignore[misc]
        metrics.LINES_RUNNING.set(len(self.running))

    def _ended(self, key: tuple[str, int]) -> None:
        self.running.pop(key, None)
        metrics.LINES_RUNNING.set(len(self.running))
        self.wake()

    async def _renew(self) -> None:
        """Renews the leases of the lines running here, a few times per lease."""
        now = time.monotonic()
        if now - self._renewed < self.lease_s / 3:
            return
        self._renewed = now
        by_batch: dict[str, list[int]] = {}
        for batch_id, line in self.running:
            by_batch.setdefault(batch_id, []).append(line)
        for batch_id, lines in by_batch.items():
            await self.store.renew(batch_id, lines, self.lease_s)

    async def _tend(self, info: BatchInfo) -> None:
        """Finalizes a job that is due: done, cancelled with nothing running, or past its window."""
        status = info.status
        if status == "cancelling":
            # Its lines running here stop now, and their claims go back: the job ends without
            # waiting for their leases to run out.
            mine = {key: task for key, task in self.running.items() if key[0] == info.id}
            for task in mine.values():
                task.cancel()
            if mine:
                await asyncio.wait(mine.values(), timeout=STOP_WAIT_S)
            await self.store.release(info.id, [line for _, line in mine])
            if await self.store.live_claims(info.id) == 0:
                await self._finalize(info, "cancelled")
        elif status == "in_progress":
            if info.expires_at and now_s() >= info.expires_at:
                await self._finalize(info, "expired")
            elif int(info.fields.get("cursor", 0)) >= info.total and info.completed + info.failed >= info.total:
                await self._finalize(info, "completed")
        elif status == "finalizing":  # a finalizer died: its lock has run out, carry on
            await self._finalize(info, info.fields.get("finalize_to", "completed"))

    def _caller(self, info: BatchInfo) -> Caller | None:
        """The job's submitter as a caller: its key's limits and usage apply to every line.
        None: the key was revoked since."""
        if not self.keys.enabled:
            return Caller(ANONYMOUS, info.tenant)
        key: ApiKey | None = next((k for k in self.keys.keys.by_digest.values() if k.id == info.key_id), None)
        return Caller(key, info.tenant) if key is not None else None

    async def _guarded(self, info: BatchInfo, line: int) -> None:
        try:
            await self._run(info, line)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the state Redis away: the line's claim runs out and it runs again
            log.warning("batch %s line %d: %s: %s", info.id, line, type(exc).__name__, exc)

    async def _run(self, info: BatchInfo, line: int) -> None:
        raw = await self.store.line(info.id, line)
        if raw is None:
            return  # finalized meanwhile
        request = json.loads(raw)
        custom_id = request["custom_id"]
        request_id = new_id("batch_req")
        links = []
        if info.traceparent:
            parent = trace.get_current_span(propagate.extract({"traceparent": info.traceparent})).get_span_context()
            if parent.is_valid:
                links.append(Link(parent, {"llmesh.batch.id": info.id}))
        attributes = {"llmesh.batch.id": info.id, "llmesh.batch.line": line, "llmesh.batch.custom_id": custom_id}
        started = time.perf_counter()
        # Each line is its own trace (a job's lines would make one unreadable trace), linked to the
        # trace that created the job.
        with tracer.start_as_current_span(
            "batch line", context=otel_context.Context(), kind=SpanKind.INTERNAL, links=links, attributes=attributes
        ) as span:
            caller = self._caller(info)
            try:
                if caller is None:
                    raise LlmeshError("the batch's API key was revoked", reason="API_KEY_REVOKED")
                body = await self.endpoints[request.get("url", info.endpoint)](request["body"], caller, request_id)
                kind, status = OUTPUT, 200
            except LlmeshError as exc:
                if exc.code in LOAD_CODES or self._worth_another_try(info.id, line, exc):
                    await self._refused(info.id, line, exc)
                    return
                kind, status = ERROR, HTTP_STATUS.get(exc.code, 500)
                body = error_body(status, exc.message, None, (exc.reason or exc.code.name).lower())
                span.set_status(Status(StatusCode.ERROR, exc.message))
            except asyncio.CancelledError:
                metrics.LINES.labels("cancelled").inc()
                raise
            except Exception as exc:
                log.exception("batch %s line %d failed", info.id, line)
                kind, status = ERROR, 500
                body = error_body(500, f"internal error: {type(exc).__name__}", None, "internal")
            finally:
                metrics.LINE_SECONDS.inc(time.perf_counter() - started)
            done = await self.store.complete(info.id, line, kind, output_line(request_id, custom_id, status, body))
            span.set_attribute("llmesh.batch.recorded", done)
        self.timeouts.pop((info.id, line), None)
        metrics.LINES.labels("ok" if kind == OUTPUT else "error").inc()
        self.target = min(float(self.max_lines), self.target + 1)
        self.backoff_s = max(MIN_BACKOFF_S, self.backoff_s / 2)
        metrics.LINES_TARGET.set(self.target)

    def _worth_another_try(self, batch_id: str, line: int, exc: LlmeshError) -> bool:
        if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
            return False
        key = (batch_id, line)
        self.timeouts[key] = self.timeouts.get(key, 0) + 1
        if self.timeouts[key] > DEADLINE_RETRIES:
            del self.timeouts[key]
            return False
        return True

    async def _refused(self, batch_id: str, line: int, exc: LlmeshError) -> None:
        """Admission said not now: fewer lines at once, a pause, and the line back for later."""
        metrics.LINES.labels("retried").inc()
        self.target = max(1.0, min(self.target, float(len(self.running))) / 2)
        delay = retry_after_of(exc)
        self.backoff_s = min(MAX_BACKOFF_S, self.backoff_s * 2)
        pause = min(MAX_BACKOFF_S, delay if delay is not None else self.backoff_s)
        self.paused_until = max(self.paused_until, time.monotonic() + pause)
        metrics.LINES_TARGET.set(self.target)
        await self.store.release(batch_id, [line])

    async def _finalize(self, info: BatchInfo, final: str) -> None:
        if not await self.store.lock_finalizing(info.id, FINALIZE_LOCK_S):
            return
        if info.status != "finalizing":
            if not await self.store.transition(info.id, (info.status,), "finalizing"):
                return  # its status changed meanwhile: the next turn looks again
            await self.store.set_fields(info.id, {"finalize_to": final})
        results = await self.store.results(info.id)
        output = [v[1:] for _, v in sorted(results.items()) if v.startswith(OUTPUT)]
        errors = [v[1:] for _, v in sorted(results.items()) if v.startswith(ERROR)]
        expired = 0
        if final == "expired":
            for line in range(info.total):
                if line not in results:
                    raw = await self.store.line(info.id, line)
                    custom_id = json.loads(raw)["custom_id"] if raw else None
                    errors.append(error_line(custom_id, "batch_expired", "the batch expired before this line ran"))
                    expired += 1
        now = now_s()
        files = []
        fields = {"status": final, f"{final}_at": str(now), "finalizing_at": str(now)}
        for name, lines, field in (
            (f"{info.id}_output.jsonl", output, "output_file_id"),
            (f"{info.id}_error.jsonl", errors, "error_file_id"),
        ):
            if not lines:
                continue
            data = ("\n".join(lines) + "\n").encode()
            file = FileInfo(new_id("file"), info.tenant, info.key_id, name, "batch_output", len(data), now, len(lines))
            files.append((file, data))
            fields[field] = file.id
        fields["completed"] = str(len(output))
        fields["failed"] = str(len(errors))
        await self.store.finish(info.id, fields, files)
        metrics.BATCHES_ENDED.labels(final).inc()
        log.info(
            "batch %s %s: %d lines ok, %d failed",
            info.id,
            final,
            len(output),
            len(errors),
            extra={"fields": {"event": "batch_ended", "batch_id": info.id, "status": final}},
        )
