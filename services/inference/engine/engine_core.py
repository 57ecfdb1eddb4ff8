"""The engine core: the worker thread that owns the model runner, the scheduler and the KV
blocks, and runs the loop. Requests reach it through its inbox (a queue of typed messages:
submissions and wake-ups, messages.py), never through shared state. Each iteration is the
scheduler's, the runner's and the scheduler's again (vLLM v1's schedule / execute / update):

1. what arrived in the inbox joins the scheduler's waiting queue; the scheduler admits waiting
   requests in priority order while rows and KV blocks last (preempting rows of a higher
   priority number for them), and `begin` frees the rows of cancelled requests and of
   requests whose stop string was found;
2. `schedule` returns each forward's `StepPlan` (the admitted prompts; then the decode rows and
   the long prompt's next chunk, in one mixed forward where the own forward serves), after
   giving every running row room for its next token (preempting when the pool is empty);
3. the executor (executor.py) runs the plan on the runner and chooses the tokens;
4. `update` appends them, runs the stop checks (EOS, stop ids, length) and frees the rows that
   ended; what the emitter must hear comes back to the core as `StepEvents`, which it hands to
   the output processor (output.py) as typed messages, with the batch segments' spans.

The core owns what is about the device and the process: the device lock, out-of-memory
retries (the scheduler says what to retry), the measured speeds, the KV and prefix gauges, and
the segment spans.

Prompts are recomputed only after an out-of-memory split or a preemption: the requeued
sequences are prefilled again with the tokens they already produced (what of it is still cached
is reused). A row yields the same greedy tokens in any batch as alone: each row attends only to
its own tokens, at its own positions.

A worker that dies (a bug, not a step failure) closes the engine: every waiting and running
request gets UNAVAILABLE, the inbox refuses, and `closed` turns the service NOT_SERVING.

The inbox also keeps what the asyncio front must know at once, under its own lock: whether the
engine is closed, how many requests wait (the queue bound), and the idle flag (nothing waiting,
nothing running: a model switch may close the engine), cleared with the submission that makes
the engine busy and set by the worker only while no submission is pending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from llmesh import errors
from services.inference.engine import metrics
from services.inference.engine.config import DEFAULT_MAX_PREFILL_TOKENS, EngineConfig
from services.inference.engine.executor import execute
from services.inference.engine.kv_manager import BlockManager, KVStats
from services.inference.engine.messages import Ended, Prefilled, Segment, Submit, TokenItem, Tokens, Wake
from services.inference.engine.model import LoadedModel
from services.inference.engine.output import Emitter
from services.inference.engine.runner import ModelRunner
from services.inference.engine.scheduler import Admission, Scheduler, Speeds, StepPlan
from services.inference.engine.sequence import SequenceState

log = logging.getLogger("llmesh.inference.engine")

_WAKE = Wake()

# torch.cuda.OutOfMemoryError is this class too.
_OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)

#: One lock per CUDA device, held by every engine's worker around each iteration and by a
#: warm-up around its graph capture: capture forbids other work on the device, and during a
#: model switch the old engine still serves there. Reentrant: warm-up's own iterations take it.
_DEVICE_LOCKS: dict[str, threading.RLock] = {}
_DEVICE_LOCKS_GUARD = threading.Lock()


def device_lock(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type != "cuda":
        return contextlib.nullcontext()
    with _DEVICE_LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(str(device), threading.RLock())


class Inbox:
    """The way into the worker from other threads: each submitted sequence, and a wake-up (a
    cancellation, the close), in one queue the worker blocks on when it has nothing to do."""

    def __init__(self, max_queue: int, scheduled: Callable[[], int], retry_after: Callable[[], float]) -> None:
        self._queue: queue.SimpleQueue[Submit | Wake] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max_queue = max_queue
        #: How many wait in the scheduler's queue (the worker's count, read as it is).
        self._scheduled = scheduled
        self._retry_after = retry_after
        #: Submitted and not yet in the scheduler's queue, and their prompt tokens.
        self.pending = 0
        self.pending_tokens = 0
        self.closed = False
        self.idle = threading.Event()
        self.idle.set()

    # --- other threads

    def submit(self, seq: SequenceState, free_rows: int) -> None:
        """Raises Unavailable (closed) or ResourceExhausted (the queue is full) at once."""
        with self._lock:
            if self.closed:
                raise errors.Unavailable("inference: the model is being unloaded", retry_after=1.0)
            # Requests the next iteration admits into free rows are not "waiting for a row".
            if self.pending + self._scheduled() >= self._max_queue + free_rows:
                raise errors.ResourceExhausted(
                    f"inference queue is full ({self._max_queue} waiting, LLMESH_MAX_QUEUE)",
                    retry_after=self._retry_after(),
                    reason="QUEUE_FULL",
                )
            self.pending += 1
            self.pending_tokens += len(seq.prompt_ids)
            self.idle.clear()
            self._queue.put(Submit(seq))

    def wake(self) -> None:
        self._queue.put(_WAKE)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self._queue.put(_WAKE)

    # --- the worker

    def receive(self, timeout: float | None) -> list[SequenceState]:
        """The sequences that arrived: waits up to `timeout` seconds for the first message
        (None: does not wait), then takes whatever else is there."""
        messages: list[Submit | Wake] = []
        try:
            messages.append(self._queue.get_nowait() if timeout is None else self._queue.get(timeout=timeout))
            while True:
                messages.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return [m.seq for m in messages if isinstance(m, Submit)]

    def taken(self, seqs: list[SequenceState]) -> None:
        """`seqs` (received) are in the scheduler's queue now (counted there from here on)."""
        with self._lock:
            self.pending -= len(seqs)
            self.pending_tokens -= sum(len(s.prompt_ids) for s in seqs)

    def settle(self, busy: bool) -> None:
        """The worker's queue and batch are empty unless `busy`: idle if nothing is pending."""
        with self._lock:
            if not busy and not self.pending:
                self.idle.set()


class EngineCore:
    """The worker of one engine (see the module docstring). Other threads use only `inbox`,
    `cancel`, `close` and the counters it keeps (read as they are)."""

    def __init__(self, model: LoadedModel, config: EngineConfig, tag: str) -> None:
        self.model = model
        self.config = config
        self.tag = tag
        seq_tokens = config.max_seq_tokens(model.max_context_tokens)
        num_blocks = config.kv_blocks(seq_tokens, model.kv_bytes_per_token, model.device)
        self.kv = BlockManager(num_blocks, config.block_tokens, config.prefix_caching)
        #: The physical KV footprint in tokens (the usable blocks), allocated here.
        self.max_total_tokens = self.kv.usable_blocks * config.block_tokens
        buckets = config.buckets(config.max_batch_size, model.device)
        self.runner = ModelRunner(model, num_blocks, config.block_tokens, seq_tokens, buckets, config.cuda_graphs)
        self.max_prefill_tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS.get(model.device.type, 2048)
        self.scheduler = Scheduler(
            config, self.kv, self.max_prefill_tokens, model.eos_ids, self.runner.can_mix, self, self.retry_after
        )
        self.output = Emitter(tag, model.verified.model_id, model.verified.version, model.tokenizer)
        self.inbox = Inbox(config.max_queue, lambda: len(self.scheduler.waiting), self.retry_after)
        self.thread: threading.Thread | None = None
        self._device = device_lock(model.device)
        self._segments = itertools.count(1)
        self._segment_id = ""
        self._segment_steps = 0
        #: Measured speeds (EWMA) that size prefill chunks while a batch decodes.
        self.speeds = Speeds()
        #: Fault injection for tests: called before each forward with ("prefill"|"decode", batch size).
        self.fault_hook: Callable[[str, int], None] | None = None
        #: Called (from the worker thread) when the worker dies and the engine closes.
        self.on_dead: list[Callable[[], None]] = []
        self.dead = False
        self.steps = 0
        #: Share of admitted prompt tokens served from the prefix cache (EWMA over admissions).
        self.prefix_hit_rate: float | None = None
        self._reported = KVStats(0, 0, 0, 0, 0, 0)
        self._report_kv()

    # ----------------------------------------------------------------- other threads

    @property
    def preemptions(self) -> int:
        """Rows requeued to give their room to others (KV blocks or priority)."""
        return self.scheduler.preemptions

    def retry_after(self) -> float:
        per_row = self.output.avg_duration / max(1, self.config.max_batch_size)
        return round(min(30.0, max(0.5, per_row * (len(self.scheduler.waiting) + self.inbox.pending))), 3)

    def cancel(self, seq: SequenceState) -> None:
        seq.cancelled = True
        self.inbox.wake()

    def close(self, reason: str) -> None:
        """Stops the worker; anything still queued or running gets UNAVAILABLE."""
        self.inbox.close()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self._fail_everything(errors.Unavailable(f"inference: {reason}", retry_after=1.0))
        self.output.sync()
        self.output.stop()
        # This engine's share of the process-wide gauges goes with it.
        metrics.PREFIX_CACHED_BLOCKS.dec(self._reported.cached_blocks)
        metrics.KV_BLOCKS_FREE.dec(self._reported.free_blocks)
        self._reported = dataclasses.replace(self._reported, cached_blocks=0, free_blocks=0)
        self.inbox.idle.set()

    # ----------------------------------------------------------------- warm-up (before the loop)

    def serve_now(self, seqs: list[SequenceState]) -> None:
        """Runs `seqs` to their end on the calling thread (warm-up, before the worker starts)."""
        self.scheduler.add(seqs)
        while self.scheduler.busy:
            self._iteration(self.scheduler.admit(self.speeds))

    def capture(self) -> None:
        """The CUDA graphs, with no other engine's step on the device meanwhile."""
        with self._device:
            self.runner.capture()

    def forget_warm_up(self) -> None:
        """Warm-up prompts are no user's: the prefix cache is emptied, the hit rate forgotten."""
        self.kv.forget_cached()
        self._report_kv()
        self.prefix_hit_rate = None

    # ----------------------------------------------------------------- the loop

    def run(self) -> None:
        """The worker thread's loop, until the engine closes or the worker dies."""
        self.thread = threading.current_thread()
        admission: Admission | None = None
        try:
            with torch.inference_mode():
                while True:
                    admission = self._next_work()
                    if admission is None:
                        return
                    with self._device:
                        self._iteration(admission)
                    admission = None
        except BaseException as exc:
            log.exception("inference worker died; closing the engine")
            self._die(exc, admission)

    def _receive(self, timeout: float | None) -> None:
        arrived = self.inbox.receive(timeout)
        if arrived:
            self.scheduler.add(arrived)
            self.inbox.taken(arrived)

    def _next_work(self) -> Admission | None:
        """Blocks until there is something to do; returns what joins the batch (maybe nothing),
        or None when the engine closes."""
        scheduler = self.scheduler
        while True:
            self._receive(None)
            now = time.monotonic()
            scheduler.expire(now)
            if self.inbox.closed:
                return None
            if scheduler.running or scheduler.chunking is not None:
                return scheduler.admit(self.speeds)
            if scheduler.waiting:
                # Empty batch: give requests arriving together a moment to share a prefill.
                left = scheduler.waiting[0].enqueued_at + self.config.batch_wait_s - now
                if left > 0 and len(scheduler.waiting) < self.config.max_batch_size:
                    self._receive(left)
                    continue
                admission = scheduler.admit(self.speeds)
                if admission.group or admission.chunked is not None:
                    return admission
                # Nothing fits an empty pool: only a request longer than the pool, which
                # validation refuses; wait rather than spin.
                self._receive(0.05)
                continue
            self.inbox.settle(busy=False)
            self._receive(1.0)

    def _die(self, exc: BaseException, admission: Admission | None = None) -> None:
        self.dead = True
        self.inbox.close()
        failure = errors.Unavailable(f"inference: the engine stopped ({exc})", retry_after=1.0)
        # The admission being worked on when the worker died is in no queue and maybe no batch.
        if admission is not None:
            for seq in [*admission.group, *([admission.chunked] if admission.chunked is not None else [])]:
                self.scheduler.end(seq, None, failure, "error")
        self._fail_everything(failure)
        self.inbox.idle.set()
        for callback in self.on_dead:
            try:
                callback()
            except Exception:
                log.exception("on_dead callback failed")

    def _fail_everything(self, failure: BaseException) -> None:
        self._receive(None)  # the inbox is closed: nothing arrives after this
        waiting = self.scheduler.take_all()
        seqs = [*waiting, *self.scheduler.holding()]
        for seq in seqs:
            self.scheduler.end(seq, None, failure, "error")
        self.scheduler.reset_batch()
        self._new_segment()

    def _iteration(self, admission: Admission) -> None:
        """One iteration: the scheduler's plans, each executed and its output handed back."""
        scheduler = self.scheduler
        try:
            scheduler.begin(admission)
            while (plan := scheduler.schedule(self.speeds)) is not None:
                self._step(plan)
            if scheduler.membership_changed:
                self._new_segment()
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            log.exception("inference step failed")
            failure = errors.LlmeshError("inference step failed", reason="ENGINE_ERROR")
            failure.__cause__ = exc
            # Sequences requeued by an OOM split earlier in this iteration are waiting again and
            # are served later; everything that holds blocks fails.
            holding = scheduler.holding()
            holding += [s for s in admission.group if s.blocks is not None and s not in holding]
            for seq in holding:
                scheduler.end(seq, None, failure, "error")
            scheduler.reset_batch()
            self._new_segment()
        finally:
            self._report_kv()
            if not scheduler.running and scheduler.chunking is None:
                self.inbox.settle(busy=bool(scheduler.waiting))

    def _step(self, plan: StepPlan) -> None:
        """Executes `plan` (retrying with less after an out-of-memory error, as the scheduler
        says), measures it, and hands the output to the scheduler."""
        started = time.perf_counter()
        current: StepPlan | None = plan
        while current is not None:
            try:
                self._inject_fault(current)
                output = execute(self.runner, current, self.model.eos_ids)
                break
            except _OOM_ERRORS:
                metrics.OOM_RETRIES.inc()
                self._empty_device_cache()
                current = self.scheduler.out_of_memory(current)
        if current is None:
            return
        elapsed = time.perf_counter() - started
        speeds = self.speeds
        if current.prefills and not current.mixed:
            computed = sum(r.end - r.start for r in current.prefills)
            if computed >= 16:  # tiny prefills say little about the speed
                speeds.prefill_tok_s = _ewma(speeds.prefill_tok_s, computed / elapsed)
        elif current.chunk is not None and not current.mixed:
            if current.chunk.end - current.chunk.start >= 16:
                speeds.prefill_tok_s = _ewma(speeds.prefill_tok_s, (current.chunk.end - current.chunk.start) / elapsed)
        elif current.decodes and not current.mixed:
            # Not a mixed step's time (the chunk is in it): step_s sizes the chunks, and
            # counting them in would grow each next chunk.
            speeds.step_s = _ewma(speeds.step_s, elapsed)
        if current.decodes:
            self.steps += 1
            self._segment_steps += 1
        self.scheduler.update(current, output)

    def _inject_fault(self, plan: StepPlan) -> None:
        hook = self.fault_hook
        if hook is None:
            return
        if plan.prefills:
            hook("prefill", len(plan.prefills))
        if plan.chunk is not None:
            hook("prefill", 1)
        if plan.decodes:
            hook("decode", len(plan.decodes))

    def _report_kv(self) -> None:
        stats = self.kv.stats()
        last = self._reported
        if stats == last:
            return
        metrics.PREFIX_CACHED_BLOCKS.inc(stats.cached_blocks - last.cached_blocks)
        metrics.KV_BLOCKS_FREE.inc(stats.free_blocks - last.free_blocks)
        if stats.hit_tokens > last.hit_tokens:
            metrics.PREFIX_HIT_TOKENS.inc(stats.hit_tokens - last.hit_tokens)
        if stats.query_tokens > last.query_tokens:
            queried = stats.query_tokens - last.query_tokens
            metrics.PREFIX_QUERY_TOKENS.inc(queried)
            # Recent, not lifetime: a router wants where reuse happens now.
            self.prefix_hit_rate = _ewma(self.prefix_hit_rate, (stats.hit_tokens - last.hit_tokens) / queried)
        if stats.evictions > last.evictions:
            metrics.PREFIX_EVICTIONS.inc(stats.evictions - last.evictions)
        self._reported = stats

    # ----------------------------------------------------------------- what the scheduler tells (StepEvents)

    def joined(self, group: list[SequenceState], started_ns: int, tokens: int, padded: int) -> None:
        for seq in group:
            if not seq.prompt_counted and not seq.internal:
                seq.prompt_counted = True
                metrics.PROMPT_TOKENS.inc(len(seq.prompt_ids))
        self._new_segment()
        for seq in group:
            if not seq.batch_id:
                seq.batch_id = self._segment_id
        rows = len(self.scheduler.running)
        self.output.put(Prefilled(group, started_ns, time.time_ns(), tokens, padded, self._segment_id, rows))

    def tokens(self, items: list[TokenItem]) -> None:
        self.output.put(Tokens(time.monotonic(), items))

    def ended(self, seq: SequenceState, reason: str | None, failure: BaseException | None, outcome: str | None) -> None:
        self.output.put(Ended(seq, reason, failure, outcome))

    def _new_segment(self) -> None:
        self.scheduler.membership_changed = False
        previous = self._segment_steps
        self._segment_id = f"{self.tag}-{next(self._segments)}"
        self._segment_steps = 0
        running = self.scheduler.running
        reserved = sum(s.reserved_tokens for s in running)
        self.output.put(Segment(self._segment_id, list(running), reserved, previous))

    def _empty_device_cache(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()


def _ewma(previous: float | None, value: float, weight: float = 0.2) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value
