"""The Batch API's operations, whatever the protocol: files (upload, read, delete) and batch jobs
(create, read, cancel, list), each scoped to the caller's tenant. Another tenant's file or job is
NotFound, never PermissionDenied: its existence is not told.

A job's input is validated line by line when it is created: a line that is not JSON, lacks a
`custom_id`, repeats one, or names an endpoint not served goes straight to the job's error file,
and the other lines run. A line may name another endpoint than the job's (one job can mix chat,
completion and embedding lines; OpenAI's API asks for one endpoint per job, a subset of this).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate

from llmesh.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.gateway.auth import Caller
from services.gateway.batches.store import IN_FLIGHT, TERMINAL, BatchInfo, BatchStore, FileInfo, new_id, now_s

BATCH_PURPOSE = "batch"
PURPOSES = frozenset({BATCH_PURPOSE})
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
MAX_ERRORS_LISTED = 100
# A full tenant waits for one of its jobs to end; jobs take minutes, so the hint is a minute.
IN_FLIGHT_RETRY_S = 60.0


@dataclass(frozen=True)
class BatchLimits:
    max_file_bytes: int
    max_lines: int
    max_in_flight: int


def error_line(custom_id: str | None, code: str, message: str, line: int | None = None) -> str:
    """A line of the error file for a request that never ran (OpenAI's batch output shape)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if line is not None:
        error["line"] = line
    return json.dumps(
        {"id": new_id("batch_req"), "custom_id": custom_id, "response": None, "error": error},
        separators=(",", ":"),
        ensure_ascii=False,
    )


def count_lines(data: bytes) -> int:
    return sum(1 for raw in data.splitlines() if raw.strip())


class BatchService:
    """Files and jobs in one store, under the limits, for the endpoints a line may name."""

    def __init__(self, store: BatchStore | None, limits: BatchLimits, endpoints: Collection[str]) -> None:
        self._store = store
        self.limits = limits
        self.endpoints = endpoints  # live: an endpoint registered later is accepted from then on
        self.on_created: list[Any] = []  # callables told of a new job (the local runner wakes)

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            raise Unavailable(
                "the Batch API keeps its jobs in the state Redis, and this gateway has none: set "
                "LLMESH_STATE_REDIS_URL (`embedded` for the one `llmesh up` runs, its default)",
                reason="BATCH_STORE_MISSING",
            )
        return self._store

    # Files.

    async def create_file(self, caller: Caller, filename: str, purpose: str, data: bytes) -> FileInfo:
        if purpose not in PURPOSES:
            raise InvalidArgument([("purpose", f"must be one of {', '.join(sorted(PURPOSES))}")])
        if len(data) > self.limits.max_file_bytes:
            raise InvalidArgument(
                [("file", f"larger than {self.limits.max_file_bytes} bytes (LLMESH_BATCH_MAX_FILE_BYTES)")]
            )
        lines = count_lines(data)
        if lines == 0:
            raise InvalidArgument([("file", "holds no request lines")])
        if lines > self.limits.max_lines:
            raise InvalidArgument([("file", f"more than {self.limits.max_lines} lines (LLMESH_BATCH_MAX_LINES)")])
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument([("file", "is not UTF-8 text")]) from None
        info = FileInfo(
            id=new_id("file"),
            tenant=caller.tenant,
            key_id=caller.key.id,
            filename=(filename or "input.jsonl")[:256],
            purpose=purpose,
            bytes=len(data),
            created_at=now_s(),
            lines=lines,
        )
        await self.store.put_file(info, data)
        return info

    async def file(self, caller: Caller, file_id: str) -> FileInfo:
        found = await self.store.file(file_id) if file_id else None
        if found is None or found.tenant != caller.tenant:
            raise NotFound(f"No such File object: {file_id}", reason="FILE_NOT_FOUND")
        return found

    async def file_content(self, caller: Caller, file_id: str) -> bytes:
        info = await self.file(caller, file_id)
        data = await self.store.file_data(info.id)
        if data is None:
            raise NotFound(f"No such File object: {file_id}", reason="FILE_NOT_FOUND")
        return data

    async def files(self, caller: Caller) -> list[FileInfo]:
        return await self.store.files(caller.tenant)

    async def delete_file(self, caller: Caller, file_id: str) -> FileInfo:
        info = await self.file(caller, file_id)
        await self.store.delete_file(info)
        return info

    # Batches.

    async def create_batch(
        self,
        caller: Caller,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None,
    ) -> BatchInfo:
        bad = []
        if endpoint not in self.endpoints:
            bad.append(("endpoint", f"must be one of {', '.join(sorted(self.endpoints))}"))
        if completion_window not in COMPLETION_WINDOWS:
            bad.append(("completion_window", f"must be one of {', '.join(COMPLETION_WINDOWS)}"))
        metadata = dict(metadata or {})
        if len(metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
        ):
            bad.append(("metadata", f"at most {MAX_METADATA_PAIRS} pairs, keys of 64 and values of 512 characters"))
        if not input_file_id:
            bad.append(("input_file_id", "required"))
        if bad:
            raise InvalidArgument(bad)
        info = await self.file(caller, input_file_id)
        if info.purpose != BATCH_PURPOSE:
            raise InvalidArgument([("input_file_id", f"file {input_file_id} was not uploaded with purpose 'batch'")])
        if await self.store.in_flight(caller.tenant) >= self.limits.max_in_flight:
            raise ResourceExhausted(
                f"tenant {caller.tenant!r} has {self.limits.max_in_flight} batches in flight "
                "(LLMESH_BATCH_MAX_IN_FLIGHT); try again when one ends",
                retry_after=IN_FLIGHT_RETRY_S,
                reason="BATCHES_IN_FLIGHT",
            )
        data = await self.store.file_data(info.id) or b""
        lines, failed = self.validate(data.decode("utf-8"), endpoint)
        if len(lines) + len(failed) > self.limits.max_lines:
            raise InvalidArgument([("input_file_id", f"more than {self.limits.max_lines} lines")])
        now = now_s()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # each line's span links to the trace that created the job
        fields = {
            "id": new_id("batch"),
            "tenant": caller.tenant,
            "key_id": caller.key.id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "created_at": str(now),
            "expires_at": str(now + COMPLETION_WINDOWS[completion_window]),
            "total": str(len(lines) + len(failed)),
            "completed": "0",
            "cursor": "0",
            "metadata": json.dumps(metadata) if metadata else "",
            "traceparent": carrier.get("traceparent", ""),
        }
        if lines:
            fields.update(status="in_progress", in_progress_at=str(now))
        else:  # nothing can run: failed at validation, its reasons in `errors`
            errors = [json.loads(v)["error"] for _, v in sorted(failed.items())][:MAX_ERRORS_LISTED]
            fields.update(status="failed", failed_at=str(now), errors=json.dumps(errors))
        await self.store.create_batch(fields, lines, failed, active=bool(lines))
        for wake in self.on_created:
            wake()
        created = await self.store.batch(fields["id"])
        assert created is not None
        return created

    def validate(self, text: str, endpoint: str) -> tuple[dict[int, str], dict[int, str]]:
        """The input's lines by number: those to run (as `{"custom_id", "body"}`), and the error
        lines of those that cannot."""
        lines: dict[int, str] = {}
        failed: dict[int, str] = {}
        seen: set[str] = set()
        index = 0
        for number, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            at = index
            index += 1
            try:
                request = json.loads(raw)
            except ValueError as exc:
                failed[at] = error_line(None, "invalid_json", f"line {number} is not JSON: {exc}", number)
                continue
            custom_id = request.get("custom_id") if isinstance(request, dict) else None
            if not isinstance(custom_id, str) or not custom_id:
                failed[at] = error_line(None, "missing_custom_id", f"line {number} has no custom_id string", number)
                continue
            problem = ""
            if custom_id in seen:
                problem = f"custom_id {custom_id!r} repeats an earlier line's"
            elif request.get("method", "POST") != "POST":
                problem = "method must be POST"
            elif request.get("url", endpoint) not in self.endpoints:
                problem = f"url must be one of {', '.join(sorted(self.endpoints))}"
            elif not isinstance(request.get("body"), dict):
                problem = "body must be a JSON object"
            seen.add(custom_id)
            if problem:
                failed[at] = error_line(custom_id, "invalid_request", f"line {number}: {problem}", number)
                continue
            url = request.get("url", endpoint)
            lines[at] = json.dumps({"custom_id": custom_id, "url": url, "body": request["body"]}, separators=(",", ":"))
        return lines, failed

    async def batch(self, caller: Caller, batch_id: str) -> BatchInfo:
        found = await self.store.batch(batch_id) if batch_id else None
        if found is None or found.tenant != caller.tenant:
            raise NotFound(f"No such Batch object: {batch_id}", reason="BATCH_NOT_FOUND")
        return found

    async def cancel(self, caller: Caller, batch_id: str) -> BatchInfo:
        """Stops a job's remaining lines: it is `cancelling` until the lines running now end,
        then `cancelled`, with the results made so far in its files."""
        found = await self.batch(caller, batch_id)
        if found.status not in TERMINAL:
            await self.store.transition(found.id, ("in_progress", "validating"), "cancelling")
            for wake in self.on_created:
                wake()
        return await self.batch(caller, batch_id)

    async def batches(self, caller: Caller, after: str = "", limit: int = 20) -> tuple[list[BatchInfo], bool]:
        if not 1 <= limit <= 100:
            raise InvalidArgument([("limit", "must be between 1 and 100")])
        return await self.store.batches(caller.tenant, after, limit)


__all__ = ["IN_FLIGHT", "BatchLimits", "BatchService", "error_line"]
