"""The engines' own load as the gateway keeps it, and the queue wait it predicts from it.

Each model's inference reports its load on a server stream (Inference.WatchLoad): running rows
and the batch room, the waiting queue, free KV blocks, the recent step time and prefill speed.
`LoadBook` holds the latest report per replica; a report older than `STALE_S` (a frozen or
vanished replica: reports come at least every second) no longer counts, and admission falls back
to its own guesses for a model with no fresh report. Between two reports the gateway counts
what it sent itself (`ModelLoad.dispatched`), so a burst that arrives within one report
interval does not all see the same free rows. A request counts as sent-but-unseen only until a
report that came after it (plus `TRANSIT_S`): past that the report holds it (running, waiting)
or it never arrived (it failed on its way, or went to a replica that died), so the estimate
cannot drift, whatever the failures, restarts and cancellations.

The predicted wait is the time until a row frees for the request: none while the requests ahead
of it (the queue and what this gateway sent since the report) fit in the free rows and KV;
otherwise, rows free as running requests end, one every `service / rows` seconds on average,
where `service` is a request's time in a row (its prefill, and the answers' mean length
learned here x the reported step time), plus the queued prompts' prefill. Not processor sharing:
a batch runs its rows side by side at the step time it reports.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from llmesh import tasks
from llmesh.errors import LlmeshError
from llmesh.v1 import inference_pb2
from services.gateway.load_report import ReplicaReport

log = logging.getLogger("llmesh.gateway.admission")

#: A report older than this no longer counts (WatchLoad reports at least every second).
STALE_S = 3.0
#: Before a step time was reported, a step is assumed to take this long.
DEFAULT_STEP_S = 0.05
#: Before any answer ended, answers are assumed this long (tokens).
DEFAULT_OUTPUT_TOKENS = 64.0
OUTPUT_ALPHA = 0.1
#: A request reaches its engine's counters within this long of being sent (a report samples
#: them every 10 ms): one sent longer before a report is in it, or is not coming. Short on
#: purpose: counted twice (pending, and running in the report) a burst sees rows taken that
#: are not, and is shed; missed for a moment it is in the next report, 10 ms on.
TRANSIT_S = 0.01
#: KV share below which a replica that tells only its usage (vLLM without block counts) is full.
KV_FULL_SHARE = 0.02
#: WatchLoad is retried this long after its stream broke, and after UNIMPLEMENTED (a backend
#: without load reports: the fallback admits meanwhile).
RETRY_S = 0.5
UNIMPLEMENTED_RETRY_S = 30.0


@dataclass(frozen=True)
class Wait:
    """A predicted start: seconds until the request gets a row, and the seconds it then takes."""

    seconds: float
    service_seconds: float
    replica: str


class ModelLoad:
    """One model's replicas as their reports tell them, and what this gateway sent since."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.replicas: dict[str, ReplicaReport] = {}
        #: When each request this gateway admitted was sent, oldest first, as long as a report
        #: may not show it yet (see `pending`).
        self._sent: deque[float] = deque()
        #: Requests that passed the check before their hops and hold their place until admitted:
        #: on their way to this engine, so later requests queue behind them.
        self.reserved = 0
        self.mean_output_tokens = DEFAULT_OUTPUT_TOKENS
        #: Seconds per token the gateway saw its streams take (EWMA): an engine's decode step
        #: leaves out its prefills and its emitter, so a stream's pace is the truer figure.
        self.seconds_per_token: float | None = None
        self.reports = 0

    @property
    def pending(self) -> int:
        """Requests sent from here that the replicas' reports may not show yet: those sent after
        the oldest fresh report (less TRANSIT_S). Not a running balance of arrivals: a request
        that failed before its engine saw it, or whose replica restarted, stops counting at the
        next report (at most a second away) instead of being pending for good."""
        now = self.clock()
        fresh = self.fresh(now)
        horizon = now - STALE_S
        if fresh:
            horizon = max(horizon, min(r.received_at for r in fresh) - TRANSIT_S)
        while self._sent and self._sent[0] <= horizon:
            self._sent.popleft()
        return len(self._sent)

    def update(self, report: ReplicaReport) -> None:
        self.replicas[report.replica] = report
        self.reports += 1

    def drop(self, replica: str | None = None) -> None:
        if replica is None:
            self.replicas.clear()
        else:
            self.replicas.pop(replica, None)

    def fresh(self, now: float) -> list[ReplicaReport]:
        return [r for r in self.replicas.values() if now - r.received_at <= STALE_S]

    def dispatched(self) -> None:
        self._sent.append(self.clock())

    def reserve(self) -> None:
        self.reserved += 1

    def unreserve(self) -> None:
        self.reserved = max(0, self.reserved - 1)

    def ended(self, output_tokens: int, seconds_per_token: float | None = None) -> None:
        if output_tokens > 0:
            self.mean_output_tokens += OUTPUT_ALPHA * (output_tokens - self.mean_output_tokens)
        if seconds_per_token is not None:
            known = self.seconds_per_token
            self.seconds_per_token = (
                seconds_per_token if known is None else known + OUTPUT_ALPHA * (seconds_per_token - known)
            )

    def predict(self, prompt_tokens: int, max_new_tokens: int, now: float, batch: bool = True) -> Wait | None:
        """The soonest start over the fresh replicas; None when none reported lately. `batch`
        False: an interactive request's, which goes ahead of batch work waiting and takes the rows
        batch work runs in (the engine preempts them)."""
        best: Wait | None = None
        replicas = self.fresh(now)
        if not batch:
            replicas = [r.for_interactive() for r in replicas]
        # What this gateway sent since the reports is spread over them (it cannot tell where
        # a channel's balancer put it).
        pending = (self.pending + self.reserved) / max(1, len(replicas))
        for r in replicas:
            wait = self._wait(r, prompt_tokens, max_new_tokens, pending)
            if best is None or wait.seconds < best.seconds:
                best = wait
        return best

    def _wait(self, r: ReplicaReport, prompt_tokens: int, max_new_tokens: int, pending: float) -> Wait:
        step = max(r.step_seconds or DEFAULT_STEP_S, self.seconds_per_token or 0.0)
        prefill_rate = r.prefill_tokens_per_second
        prefill = prompt_tokens / prefill_rate if prefill_rate else step
        own = prefill + max_new_tokens * step
        ahead = r.waiting + pending
        if r.max_running:
            rows = r.max_running
            free_rows: float = max(0, r.max_running - r.running)
        else:
            # A server that does not tell its batch room (vLLM's max_num_seqs) has room while it
            # queues nothing: what was sent since its report is not a queue there; once it
            # queues, its rows are the ones running.
            rows = max(1, r.running)
            free_rows = math.inf if not r.waiting else 0
            if not r.waiting:
                ahead = 0
        if ahead < free_rows and self._kv_room(r, prompt_tokens + max_new_tokens, ahead):
            return Wait(0.0, own, r.replica)
        mean_service = prefill + self.mean_output_tokens * step
        queued_prefill = r.waiting_prompt_tokens / prefill_rate if prefill_rate else 0.0
        behind = ahead - (free_rows if math.isfinite(free_rows) else 0) + 1
        return Wait(max(0.0, behind) * mean_service / rows + queued_prefill, own, r.replica)

    @staticmethod
    def _kv_room(r: ReplicaReport, tokens: int, ahead: float) -> bool:
        if not r.kv_blocks_total:
            return True
        if not r.block_tokens:  # usage only
            return r.kv_blocks_free / r.kv_blocks_total > KV_FULL_SHARE
        need = math.ceil(tokens / r.block_tokens)
        # Every request ahead needs at least one block too.
        return r.kv_blocks_free >= need + math.ceil(ahead)


class LoadBook:
    """Every model's load (by route name: "" is the unnamed model)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.models: dict[str, ModelLoad] = {}

    def model(self, name: str) -> ModelLoad:
        found = self.models.get(name)
        if found is None:
            found = self.models[name] = ModelLoad(self.clock)
        return found

    def update(self, name: str, message: inference_pb2.LoadReport) -> None:
        """A LoadReport from `name`'s inference (one with `reported` False drops that replica)."""
        load = self.model(name)
        if not message.reported:
            load.drop(message.replica)
            return
        load.update(ReplicaReport.from_message(message, self.clock()))

    def predict(self, name: str, prompt_tokens: int, max_new_tokens: int, batch: bool = True) -> Wait | None:
        found = self.models.get(name)
        return None if found is None else found.predict(prompt_tokens, max_new_tokens, self.clock(), batch)


class LoadWatcher:
    """Keeps one model's WatchLoad stream open and feeds its reports to the book; a broken
    stream is opened again after RETRY_S (the stale reports stop counting meanwhile), a backend
    without the RPC is asked again after UNIMPLEMENTED_RETRY_S."""

    def __init__(self, book: LoadBook, name: str, watch: Callable[[], AsyncIterator[inference_pb2.LoadReport]]) -> None:
        self.book = book
        self.name = name
        self.watch = watch
        self.task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await tasks.stop(self.task)

    async def _run(self) -> None:
        while True:
            retry = RETRY_S
            try:
                async for message in self.watch():
                    self.book.update(self.name, message)
                    self.connected.set()
            except LlmeshError as exc:
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("inference %r reports no load; admission falls back to its own guesses", self.name)
                    retry = UNIMPLEMENTED_RETRY_S
            except Exception:  # never let the watcher die: admission would lose its signal for good
                log.exception("watching the load of %r failed", self.name)
            self.book.model(self.name).drop()
            await asyncio.sleep(retry)
